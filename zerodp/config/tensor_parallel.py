"""`tensor_parallel`: DeepSpeed's AutoTP block, and what zerodp adds to it.

`autotp_size` T splits every Linear the model's plan names across T
consecutive ranks (see docs/tensor-parallel.md). DeepSpeed's other keys of
the block are accepted where they ask for what zerodp does (`tp.tp_size`
equal to `autotp_size` or 1, `tp_grain_size` 1, no `mpu` / `tp_group` object,
a `dtype` that matches the `bf16` / `fp16` blocks); `tp_overlap_comm` and
`keep_module_on_host` change nothing here and are listed in the config
warning; the rest (`partition_config`, `preset_model`, kernel injection, a
vocabulary-parallel loss) is refused by `zerodp.config.deepspeed_keys.unsupported`.

zerodp's own keys: `plan`, module-name patterns mapped to a split style, for
a model without a plan of its own (or to replace it), and
`verify_replicated`, a debug check that the parameters the plan leaves whole
stay bitwise equal across each tensor-parallel group after every step.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from zerodp.config.errors import SectionRuleError
from zerodp.config.fields import Bool, NonNegInt, PosInt, Section, or_list, reject

# The split styles a plan may name: HF's names (`base_model_tp_plan`, `_tp_plan`) for the
# ones zerodp implements. "colwise_rep" is HF's older name of "colwise_gather_output".
COLWISE = "colwise"
ROWWISE = "rowwise"
COLWISE_GATHER_OUTPUT = "colwise_gather_output"
EMBEDDING_ROWWISE = "embedding_rowwise"
PLAN_STYLES = (COLWISE, ROWWISE, COLWISE_GATHER_OUTPUT, EMBEDDING_ROWWISE)
STYLE_ALIASES = {"colwise_rep": COLWISE_GATHER_OUTPUT}

# DeepSpeed's spellings of the model dtype, by the precision they ask for.
_DTYPES = {
    "fp32": "fp32",
    "float32": "fp32",
    "torch.float32": "fp32",
    "float": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "torch.float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def _plan(value: object) -> dict[str, str] | None:
    allowed = (
        "null, or a JSON object of module-name patterns ('*' matches one name part, e.g. "
        f'"layers.*.mlp.fc1") to {or_list(PLAN_STYLES)}'
    )
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise reject(allowed)
    out = {}
    for pattern, style in value.items():
        if not isinstance(pattern, str) or not pattern or not isinstance(style, str):
            raise reject(allowed)
        canonical = STYLE_ALIASES.get(style.lower(), style.lower())
        if canonical not in PLAN_STYLES:
            raise reject(allowed)
        out[pattern] = canonical
    return out


def _dtype(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in _DTYPES:
        raise reject(f"null or one of {or_list(sorted(_DTYPES))}")
    return _DTYPES[value.lower()]


Plan = Annotated[dict[str, str] | None, BeforeValidator(_plan)]
ModelDtype = Annotated[Literal["fp32", "fp16", "bf16"] | None, BeforeValidator(_dtype)]


class TensorGroupConfig(Section):
    """DeepSpeed's `tensor_parallel.tp` block. zerodp builds the tensor groups itself (from
    `autotp_size`), so it takes no group object and no other size."""

    tp_size: PosInt = 1
    tp_grain_size: PosInt = 1
    mpu: None = None
    tp_group: None = None


class TensorParallelConfig(Section):
    """The `tensor_parallel` section (see the module docstring)."""

    autotp_size: NonNegInt = 0  # 0 or 1: off
    dtype: ModelDtype = None
    tp: TensorGroupConfig = Field(default_factory=TensorGroupConfig)
    # zerodp's: module-name patterns -> style; replaces the model's own plan when given.
    plan: Plan = None
    # zerodp's: after every step, check that the parameters the plan leaves whole are bitwise
    # equal across each tensor group (one small all-gather of checksums per step).
    verify_replicated: Bool = False

    @property
    def size(self) -> int:
        """T: the ranks each split weight is spread over (1: no tensor parallelism)."""
        return max(1, self.autotp_size)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @model_validator(mode="after")
    def _group_block_agrees(self) -> TensorParallelConfig:
        tp = self.tp
        if tp.tp_size not in (1, self.size):
            raise SectionRuleError(
                ("tp.tp_size", "autotp_size"),
                lambda k: (
                    f"config key '{k[0]}': got {tp.tp_size}, which differs from '{k[1]}' "
                    f"({self.autotp_size}); zerodp reads the tensor-parallel size from '{k[1]}': "
                    f"remove '{k[0]}' or set it to {self.size}"
                ),
            )
        if tp.tp_grain_size != 1:
            raise SectionRuleError(
                ("tp.tp_grain_size",),
                lambda k: (
                    f"config key '{k[0]}': got {tp.tp_grain_size}; zerodp splits every weight "
                    f"into equal parts (its sizes must divide by autotp_size): set '{k[0]}' to 1"
                ),
            )
        return self


def precision_mismatch(tp: TensorParallelConfig, bf16: bool, fp16: bool) -> str | None:
    """What is wrong with `tensor_parallel.dtype` against the bf16 / fp16 blocks (None: fine)."""
    if tp.dtype is None:
        return None
    actual = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    if tp.dtype == actual:
        return None
    return (
        f"config key 'tensor_parallel.dtype': got {tp.dtype!r}, but the model trains in "
        f"{actual} (zerodp takes the model's dtype from the 'bf16' and 'fp16' blocks): remove "
        f"'tensor_parallel.dtype', or enable the block for {tp.dtype}"
    )
