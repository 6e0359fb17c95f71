"""The zerodp configuration as frozen pydantic models, one per JSON section.

Attribute names equal DeepSpeed's JSON keys so existing config files load
unchanged. Every section forbids unknown keys: a misspelled key silently
falling back to a default is the most expensive config bug there is.

Scalar fields use the small validators below instead of pydantic's lax
coercion, because lax mode would turn `"false"` into `False` and `true` into
`1`; a JSON author who wrote the wrong type should hear about it. Integral
floats are the one coercion kept, since JSON authors write sizes as `5e8`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from zerodp.config.batch import BatchSizes
from zerodp.config.errors import NestedSectionError, SectionRuleError, to_config_error
from zerodp.errors import ConfigError


def _or_list(options: Sequence[object]) -> str:
    shown = [repr(o) for o in options]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def _reject(allowed: str) -> PydanticCustomError:
    return PydanticCustomError("zerodp_value", "allowed: {allowed}", {"allowed": allowed})


def _int(lo: int | None = None, choices: tuple[int, ...] | None = None) -> BeforeValidator:
    if choices is not None:
        allowed = _or_list(choices)
    else:
        allowed = "an integer" if lo is None else f"an integer >= {lo}"

    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _reject(allowed)
        if isinstance(value, float) and not value.is_integer():
            raise _reject(allowed)
        number = int(value)
        if (lo is not None and number < lo) or (choices is not None and number not in choices):
            raise _reject(allowed)
        return number

    return BeforeValidator(check)


def _float(
    *, ge: float | None = None, gt: float | None = None, lt: float | None = None
) -> BeforeValidator:
    if ge is not None and lt is not None:
        allowed = f"a number in [{ge:g}, {lt:g})"
    elif ge is not None:
        allowed = f"a number >= {ge:g}"
    elif gt is not None:
        allowed = f"a number > {gt:g}"
    else:
        allowed = "a finite number"

    def check(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _reject(allowed)
        number = float(value)
        if not math.isfinite(number):
            raise _reject(allowed)
        if (
            (ge is not None and number < ge)
            or (gt is not None and number <= gt)
            or (lt is not None and number >= lt)
        ):
            raise _reject(allowed)
        return number

    return BeforeValidator(check)


def _exact(kind: type, allowed: str) -> BeforeValidator:
    def check(value: object) -> object:
        if type(value) is not kind:
            raise _reject(allowed)
        return value

    return BeforeValidator(check)


def _choice(options: Sequence[str]) -> BeforeValidator:
    """Match case-insensitively and store the canonical spelling."""
    canonical = {o.lower(): o for o in options}
    allowed = _or_list(options)

    def check(value: object) -> str:
        if not isinstance(value, str) or value.lower() not in canonical:
            raise _reject(allowed)
        return canonical[value.lower()]

    return BeforeValidator(check)


PosInt = Annotated[int, _int(lo=1)]
NonNegInt = Annotated[int, _int(lo=0)]
PosFloat = Annotated[float, _float(gt=0.0)]
NonNegFloat = Annotated[float, _float(ge=0.0)]
UnitFloat = Annotated[float, _float(ge=0.0, lt=1.0)]
Bool = Annotated[bool, _exact(bool, "true or false")]
Str = Annotated[str, _exact(str, "a string")]
LastIteration = Annotated[int, _int(lo=-1)]
WarmupType = Annotated[Literal["log", "linear"], _choice(("log", "linear"))]


def _betas(value: object) -> tuple[float, float]:
    allowed = "a list of two numbers in [0, 1), e.g. [0.9, 0.999]"
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise _reject(allowed)
    out: list[float] = []
    for beta in value:
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0.0 <= beta < 1.0:
            raise _reject(allowed)
        out.append(float(beta))
    return (out[0], out[1])


Betas = Annotated[tuple[float, float], BeforeValidator(_betas)]


_S = TypeVar("_S", bound="Section")


class Section(BaseModel):
    """Base of every config section: frozen, closed to unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def from_dict(cls: type[_S], data: Mapping[str, Any]) -> _S:
        """Validate `data`, raising `ConfigError` (key paths relative to this section)."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise to_config_error(exc, cls) from None


def _must_exceed(bigger: str, smaller: str, big: int, small: int) -> SectionRuleError:
    return SectionRuleError(
        (bigger, smaller),
        lambda k: (
            f"config key '{k[0]}': got {big}; allowed: an integer > '{k[1]}' ({small}); "
            f"raise '{k[0]}' or lower '{k[1]}'"
        ),
    )


# --- optimizer -------------------------------------------------------------


class AdamParams(Section):
    """Params of "Adam" and "AdamW"; `adam_w_mode` only matters for "Adam"."""

    lr: PosFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat = 0.0
    amsgrad: Bool = False
    adam_w_mode: Bool = True
    torch_adam: Bool = False  # accepted for DeepSpeed configs; zerodp always uses torch's


class SGDParams(Section):
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


OPTIMIZER_PARAMS: dict[str, type[Section]] = {
    "Adam": AdamParams,
    "AdamW": AdamParams,
    "SGD": SGDParams,
}

_TORCH_DROPPED = ("adam_w_mode", "torch_adam")


def _validated_params(model: type[Section], params: dict[str, Any]) -> dict[str, Any]:
    try:
        return model.model_validate(params).model_dump()
    except ValidationError as exc:
        raise NestedSectionError(model, exc.errors(), at=("params",)) from None


class OptimizerConfig(Section):
    """`params` is stored validated, with every default filled in."""

    type: Annotated[Literal["Adam", "AdamW", "SGD"], _choice(tuple(OPTIMIZER_PARAMS))] = Field(
        description="one of 'Adam', 'AdamW' or 'SGD'"
    )
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_params(self) -> OptimizerConfig:
        # Which keys are allowed in params depends on `type`, so validate here.
        object.__setattr__(
            self, "params", _validated_params(OPTIMIZER_PARAMS[self.type], self.params)
        )
        return self

    def torch_kwargs(self) -> tuple[str, dict[str, Any]]:
        """The `torch.optim` class name and its constructor kwargs.

        DeepSpeed's "Adam" means decoupled weight decay unless `adam_w_mode` is
        false, so it maps to torch's AdamW by default.
        """
        name: str = self.type
        if name == "Adam" and self.params["adam_w_mode"]:
            name = "AdamW"
        kwargs = {k: v for k, v in self.params.items() if k not in _TORCH_DROPPED}
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        return name, kwargs


# --- scheduler -------------------------------------------------------------


class WarmupLRParams(Section):
    warmup_min_lr: NonNegFloat = 0.0
    warmup_max_lr: NonNegFloat = 0.001
    warmup_num_steps: PosInt = 1000
    warmup_type: WarmupType = "log"
    last_batch_iteration: LastIteration = -1


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: PosInt = Field(description="the step where lr reaches 0")

    @model_validator(mode="after")
    def _ends_after_warmup(self) -> WarmupDecayLRParams:
        if self.total_num_steps <= self.warmup_num_steps:
            raise _must_exceed(
                "total_num_steps", "warmup_num_steps", self.total_num_steps, self.warmup_num_steps
            )
        return self


class WarmupCosineLRParams(Section):
    total_num_steps: PosInt = Field(description="the step where the cosine reaches its minimum")
    warmup_min_ratio: UnitFloat = 0.0
    warmup_num_steps: PosInt = 1000
    cos_min_ratio: UnitFloat = 0.0001
    warmup_type: WarmupType = "log"
    last_batch_iteration: LastIteration = -1

    @model_validator(mode="after")
    def _ends_after_warmup(self) -> WarmupCosineLRParams:
        if self.total_num_steps <= self.warmup_num_steps:
            raise _must_exceed(
                "total_num_steps", "warmup_num_steps", self.total_num_steps, self.warmup_num_steps
            )
        return self


SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}


class SchedulerConfig(Section):
    """`params` is stored validated, with every default filled in."""

    type: Annotated[
        Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"], _choice(tuple(SCHEDULER_PARAMS))
    ] = Field(description="one of 'WarmupLR', 'WarmupDecayLR' or 'WarmupCosineLR'")
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_params(self) -> SchedulerConfig:
        object.__setattr__(
            self, "params", _validated_params(SCHEDULER_PARAMS[self.type], self.params)
        )
        return self


# --- the other sections ----------------------------------------------------


class ZeroConfig(Section):
    stage: Annotated[Literal[0, 1, 2, 3], _int(choices=(0, 1, 2, 3))] = 0
    reduce_bucket_size: PosInt = 500_000_000
    allgather_bucket_size: PosInt = 500_000_000
    overlap_comm: Bool = True
    contiguous_gradients: Bool = True
    stage3_param_persistence_threshold: NonNegInt = 100_000
    stage3_prefetch_bucket_size: NonNegInt = 50_000_000
    stage3_max_live_parameters: PosInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegInt = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: Bool = False


class BF16Config(Section):
    enabled: Bool = False


class FP16Config(Section):
    enabled: Bool = False
    loss_scale: NonNegFloat = 0.0  # 0 selects dynamic loss scaling
    initial_scale_power: NonNegInt = 16
    loss_scale_window: PosInt = 1000
    hysteresis: PosInt = 2
    min_loss_scale: PosFloat = 1.0


class MonitorConfig(Section):
    enabled: Bool = False
    output_path: Str = ""
    job_name: Str = "zerodp_job"


class EigenvalueConfig(Section):
    enabled: Bool = False
    verbose: Bool = False
    max_iter: PosInt = 100
    tol: PosFloat = 1e-2
    stability: NonNegFloat = 1e-6
    gas_boundary_resolution: PosInt = 1
    layer_name: Str = ""
    layer_num: NonNegInt = 0


class ZeroDPConfig(Section):
    """The whole config. Build it with `load_config`, which also resolves batch sizes.

    Constructed directly, the three batch-size keys may be None; `load_config`
    returns a copy in which all three are ints consistent with the world size.
    Construction raises `ConfigError`, never pydantic's exception type.
    """

    def __init__(self, **data: Any) -> None:
        # Only the root overrides __init__: pydantic calls a custom __init__ for
        # nested models too, which would flatten their errors into one string.
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise to_config_error(exc, type(self)) from None

    train_batch_size: PosInt | None = None
    train_micro_batch_size_per_gpu: PosInt | None = None
    gradient_accumulation_steps: PosInt | None = None
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: NonNegFloat = 0.0  # 0 turns clipping off
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    steps_per_print: PosInt = 10
    bf16: BF16Config = Field(default_factory=BF16Config)
    fp16: FP16Config = Field(default_factory=FP16Config)
    communication_data_type: (
        Annotated[Literal["fp32", "fp16", "bf16"], _choice(("fp32", "fp16", "bf16"))] | None
    ) = None
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig)
    eigenvalue: EigenvalueConfig = Field(default_factory=EigenvalueConfig)
    dataloader_drop_last: Bool = False
    seed: NonNegInt | None = None

    @model_validator(mode="after")
    def _one_half_precision(self) -> ZeroDPConfig:
        if self.bf16.enabled and self.fp16.enabled:
            raise SectionRuleError(
                ("bf16.enabled", "fp16.enabled"),
                lambda k: (
                    f"config keys '{k[0]}' and '{k[1]}' are both true; allowed: at most one "
                    "half-precision mode; set one of them to false"
                ),
            )
        return self

    @property
    def batch_sizes(self) -> BatchSizes:
        """The resolved batch sizes as plain ints, for code that wants them typed as such."""
        t, m, g = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )
        if t is None or m is None or g is None:
            raise ConfigError(
                "batch sizes are not resolved; build the config with "
                "zerodp.config.load_config(config, world_size=...)"
            )
        return BatchSizes(t, m, g)
