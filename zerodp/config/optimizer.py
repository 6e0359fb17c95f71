"""The `optimizer` section: a torch.optim class name and its constructor kwargs.

Every optimizer type here but "Muon", "Lamb" and "Lion" is a torch.optim class
whose update is elementwise (it steps the flat shards ZeRO keeps); the engine
builds it with `getattr(torch.optim, name)(groups, **kwargs)` from
`torch_kwargs()`. "Muon" is DeepSpeed's: torch's Muon for the matrices and
Adam(W) for the rest, with DeepSpeed's parameter names and defaults
(`MuonParams`; the engine splits the parameters in `zerodp.optim.muon_config`).
"Lamb" and "Lion" are zerodp's implementations of DeepSpeed's FusedLamb and
FusedLion (`zerodp.optim.lamb`, `zerodp.optim.lion`). Each params model lists
exactly the keys that optimizer takes, with the defaults DeepSpeed 0.19.8
applies on the path it takes (torch's for the classes it builds from
torch.optim), so a misspelled key is reported with the nearest valid one.

DeepSpeed's own optimizer names (`FusedAdam`, `CPUAdam`, ...) and its extra
params (`bias_correction`, `torch_adam`, ...) are translated before these
models see the config; see `zerodp.config.deepspeed_keys`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from zerodp.config.errors import NestedSectionError, SectionRuleError
from zerodp.config.fields import (
    Betas,
    Bool,
    NonNegFloat,
    PosFloat,
    Section,
    UnitFloat,
    choice,
)

OptBool = Bool | None  # None: torch's own choice (e.g. `foreach` on CUDA)


class _TorchImplementation(Section):
    """torch's implementation switches, passed through when set.

    `fused` asks torch for its fused kernel, `foreach` for its multi-tensor
    loop; left unset (null) torch picks, as it does when you build the
    optimizer yourself. DeepSpeed's `FusedAdam` is its own CUDA kernel; the
    closest torch equivalent is `"fused": true`, which zerodp leaves to you
    because torch's fused kernels do not cover every device and dtype.
    """

    foreach: OptBool = None
    fused: OptBool = None

    @model_validator(mode="after")
    def _not_both(self) -> _TorchImplementation:
        if self.foreach and self.fused:
            raise SectionRuleError(
                ("foreach", "fused"),
                lambda k: (
                    f"config keys '{k[0]}' and '{k[1]}' are both true; allowed: at most one "
                    "(torch cannot use both implementations); set one of them to false or null"
                ),
            )
        return self


class AdamParams(_TorchImplementation):
    """Params of "Adam" and "AdamW"; `adam_w_mode` only matters for "Adam".

    `bias_correction: false` is DeepSpeed's Adam without bias correction, zerodp's own
    `UncorrectedAdam` (torch's always corrects), which has neither amsgrad nor a fused or
    foreach kernel.

    `torch_adam: true` is DeepSpeed's switch to `torch.optim.AdamW` (or `Adam` with
    `adam_w_mode: false`) built with only the config's keys: torch's own defaults apply
    (AdamW's `weight_decay` 0.01) and torch picks the kernel. Without it DeepSpeed
    builds its FusedAdam or CPU Adam, whose `weight_decay` default is 0. So
    `weight_decay` left out (None here) is resolved by `OptimizerConfig`, which knows
    the type.
    """

    lr: PosFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat | None = None
    amsgrad: Bool = False
    adam_w_mode: Bool = True
    bias_correction: Bool = True
    torch_adam: Bool = False

    @model_validator(mode="after")
    def _uncorrected_has_no_variants(self) -> AdamParams:
        if self.bias_correction:
            return self
        if self.torch_adam:
            raise SectionRuleError(
                ("bias_correction", "torch_adam"),
                lambda k: (
                    f"config keys '{k[0]}' false and '{k[1]}' true: torch's Adam and AdamW "
                    f"always correct the bias (DeepSpeed passes '{k[0]}' to them and fails); "
                    f"remove '{k[1]}' or '{k[0]}'"
                ),
            )
        for key in ("amsgrad", "fused", "foreach"):
            if getattr(self, key):
                raise SectionRuleError(
                    ("bias_correction", key),
                    lambda k: (
                        f"config keys '{k[0]}' false and '{k[1]}' true: Adam without bias "
                        f"correction has no {k[1]} variant; remove '{k[1]}' or set "
                        f"'{k[0]}' to true"
                    ),
                )
        return self


class _NoFused(Section):
    """Adamax and RMSprop: torch has a `foreach` loop for them but no fused kernel."""

    foreach: OptBool = None


class SGDParams(_TorchImplementation):
    lr: PosFloat = 1e-3
    momentum: NonNegFloat = 0.0
    dampening: NonNegFloat = 0.0
    weight_decay: NonNegFloat = 0.0
    nesterov: Bool = False

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        # torch.optim.SGD would reject this only when the engine builds it, on every rank.
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            m, d = self.momentum, self.dampening
            raise SectionRuleError(
                ("nesterov", "momentum", "dampening"),
                lambda k: (
                    f"config key '{k[0]}': got True while '{k[1]}' is {m:g} and '{k[2]}' is "
                    f"{d:g}; allowed: true only with '{k[1]}' > 0 and '{k[2]}' 0; "
                    f"set them or set '{k[0]}' to false"
                ),
            )
        return self


class AdagradParams(_TorchImplementation):
    lr: PosFloat = 1e-2
    lr_decay: NonNegFloat = 0.0
    weight_decay: NonNegFloat = 0.0
    initial_accumulator_value: NonNegFloat = 0.0
    eps: PosFloat = 1e-10


class AdamaxParams(_NoFused):
    lr: PosFloat = 2e-3
    betas: Betas = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat = 0.0


class RMSpropParams(_NoFused):
    lr: PosFloat = 1e-2
    alpha: UnitFloat = 0.99
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat = 0.0
    momentum: NonNegFloat = 0.0
    centered: Bool = False


class LambParams(Section):
    """DeepSpeed FusedLamb's arguments and defaults (`zerodp.optim.lamb`)."""

    lr: PosFloat = 1e-3
    bias_correction: Bool = True
    betas: Betas = (0.9, 0.999)
    eps: PosFloat = 1e-8
    eps_inside_sqrt: Bool = False
    weight_decay: NonNegFloat = 0.0
    max_coeff: NonNegFloat = 10.0
    min_coeff: NonNegFloat = 0.01
    amsgrad: Bool = False

    @model_validator(mode="after")
    def _no_amsgrad(self) -> LambParams:
        if self.amsgrad:
            raise SectionRuleError(
                ("amsgrad",),
                lambda k: (
                    f"config key '{k[0]}': got true; LAMB has no AMSGrad variant (DeepSpeed's "
                    f"FusedLamb refuses it too); remove '{k[0]}' or set it to false"
                ),
            )
        return self


class LionParams(Section):
    """DeepSpeed FusedLion's arguments and defaults (`zerodp.optim.lion`)."""

    lr: PosFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    weight_decay: NonNegFloat = 0.0


class MuonParams(Section):
    """DeepSpeed's "Muon": `lr` for both halves unless `muon_lr` / `adam_lr` say otherwise;
    `momentum` and `ns_method` are Muon's, `betas` and `eps` the auxiliary Adam's,
    `weight_decay` both's. Defaults are DeepSpeed's (0.02 and 3e-4 as the halves' lr)."""

    lr: PosFloat | None = None
    muon_lr: PosFloat | None = None
    adam_lr: PosFloat | None = None
    momentum: NonNegFloat = 0.95
    weight_decay: NonNegFloat = 0.0
    betas: Betas = (0.9, 0.95)
    eps: PosFloat = 1e-10
    ns_method: Annotated[Literal["gram", "standard"], choice(("gram", "standard"))] = "gram"
    adam_w_mode: Bool = True
    per_head_muon: Bool = False
    # DeepSpeed's aux Adam is then torch's AdamW, as zerodp's always is; the aux groups carry
    # their own weight_decay (0 unless set), so no torch default shows through.
    torch_adam: Bool = False

    @model_validator(mode="after")
    def _no_per_head(self) -> MuonParams:
        if self.per_head_muon:
            raise SectionRuleError(
                ("per_head_muon",),
                lambda k: (
                    f"config key '{k[0]}': got true; zerodp orthogonalizes each matrix whole "
                    f"(torch.optim.Muon); remove '{k[0]}' or set it to false"
                ),
            )
        return self


OPTIMIZER_PARAMS: dict[str, type[Section]] = {
    "Adam": AdamParams,
    "AdamW": AdamParams,
    "SGD": SGDParams,
    "Adagrad": AdagradParams,
    "Adamax": AdamaxParams,
    "RMSprop": RMSpropParams,
    "Muon": MuonParams,
    "Lamb": LambParams,
    "Lion": LionParams,
}

OptimizerType = Literal[
    "Adam", "AdamW", "SGD", "Adagrad", "Adamax", "RMSprop", "Muon", "Lamb", "Lion"
]

_NOT_TORCH_KWARGS = ("adam_w_mode", "bias_correction", "torch_adam")
TORCH_ADAMW_WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default, which torch_adam lets through
UNCORRECTED_ADAM = "UncorrectedAdam"  # zerodp.optim.uncorrected_adam: bias_correction false


def validated_params(model: type[Section], params: dict[str, Any]) -> dict[str, Any]:
    """`params` checked by `model`, every default filled in (errors keep their key paths)."""
    try:
        return model.model_validate(params).model_dump()
    except ValidationError as exc:
        raise NestedSectionError(model, exc.errors(), at=("params",)) from None


class OptimizerConfig(Section):
    """`params` is stored validated, with every default filled in."""

    type: Annotated[OptimizerType, choice(tuple(OPTIMIZER_PARAMS))] = Field(
        description="one of " + ", ".join(repr(t) for t in OPTIMIZER_PARAMS)
    )
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_params(self) -> OptimizerConfig:
        # Which keys are allowed in params depends on `type`, so validate here.
        params = validated_params(OPTIMIZER_PARAMS[self.type], self.params)
        if self.type in ("Adam", "AdamW") and params["weight_decay"] is None:
            params["weight_decay"] = adam_weight_decay_default(self.type, params)
        object.__setattr__(self, "params", params)
        return self

    def torch_kwargs(self) -> tuple[str, dict[str, Any]]:
        """The `torch.optim` class name and its constructor kwargs.

        DeepSpeed's "Adam" means decoupled weight decay unless `adam_w_mode` is
        false, so it maps to torch's AdamW by default; with `bias_correction` false
        either is zerodp's `UncorrectedAdam`. Switches left unset
        (`foreach`, `fused`: null) are not passed, so torch chooses. "Muon" is
        two optimizers: see `zerodp.optim.muon_config`.
        """
        if self.type == "Muon":
            raise RuntimeError("internal error: Muon's config builds two optimizers")
        name: str = self.type
        if name in ("Lamb", "Lion"):
            return name, {k: v for k, v in self.params.items() if k != "amsgrad"}
        if name == "Adam" and self.params["adam_w_mode"]:
            name = "AdamW"
        if name in ("Adam", "AdamW") and not self.params["bias_correction"]:
            kwargs = {k: self.params[k] for k in ("lr", "eps", "weight_decay")}
            return UNCORRECTED_ADAM, {
                **kwargs,
                "betas": tuple(self.params["betas"]),
                "adam_w_mode": name == "AdamW",
            }
        kwargs = {
            k: v for k, v in self.params.items() if k not in _NOT_TORCH_KWARGS and v is not None
        }
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        return name, kwargs


def adam_weight_decay_default(optimizer_type: str, params: dict[str, Any]) -> float:
    """The weight decay DeepSpeed 0.19.8 applies to "Adam"/"AdamW" when the config has none.

    With `torch_adam` it builds `torch.optim.AdamW` (for "AdamW", or "Adam" in its default
    `adam_w_mode`) without a weight_decay argument, so torch's default 0.01 applies, or
    `torch.optim.Adam` (default 0). Otherwise its FusedAdam or DeepSpeedCPUAdam, whose
    default is 0.
    """
    decoupled = optimizer_type == "AdamW" or params["adam_w_mode"]
    return TORCH_ADAMW_WEIGHT_DECAY if params["torch_adam"] and decoupled else 0.0
