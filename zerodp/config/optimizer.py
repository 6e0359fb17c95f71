"""The `optimizer` section: a torch.optim class name and its constructor kwargs.

Every optimizer type here but "Muon" is a torch.optim class whose update is
elementwise (it steps the flat shards ZeRO keeps); the engine builds it with
`getattr(torch.optim, name)(groups, **kwargs)` from `torch_kwargs()`. "Muon"
is DeepSpeed's: torch's Muon for the matrices and Adam(W) for the rest, with
DeepSpeed's parameter names and defaults (`MuonParams`; the engine splits the
parameters in `zerodp.optim.muon_config`). Each params model lists exactly
the keys that optimizer takes, with torch's defaults (DeepSpeed's for Adam's
`weight_decay` and for Muon), so a misspelled key is reported with the
nearest valid one.

DeepSpeed's own optimizer names (`FusedAdam`, `CPUAdam`, ...) and its extra
params (`bias_correction`, `torch_adam`, ...) are translated before these
models see the config; see `zerodp.config.compat`.
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
    """

    lr: PosFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat = 0.0
    amsgrad: Bool = False
    adam_w_mode: Bool = True
    bias_correction: Bool = True

    @model_validator(mode="after")
    def _uncorrected_has_no_variants(self) -> AdamParams:
        if self.bias_correction:
            return self
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
}

OptimizerType = Literal["Adam", "AdamW", "SGD", "Adagrad", "Adamax", "RMSprop", "Muon"]

_NOT_TORCH_KWARGS = ("adam_w_mode", "bias_correction")
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
        object.__setattr__(
            self, "params", validated_params(OPTIMIZER_PARAMS[self.type], self.params)
        )
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
