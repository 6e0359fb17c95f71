"""The `scheduler` section: DeepSpeed's warmup schedulers, with DeepSpeed's parameter names.

The engine builds them itself (zerodp.optim.schedulers); DeepSpeed's other
schedulers (OneCycle, LRRangeTest) are reported as not implemented before
these models see the config, with the torch scheduler to pass instead.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from zerodp.config.fields import (
    LastIteration,
    NonNegFloat,
    PosInt,
    Section,
    UnitFloat,
    WarmupType,
    choice,
)
from zerodp.config.optimizer import validated_params


class WarmupLRParams(Section):
    warmup_min_lr: NonNegFloat = 0.0
    # None: each param group's own lr (DeepSpeed's WarmupLR default).
    warmup_max_lr: NonNegFloat | None = None
    warmup_num_steps: PosInt = 1000
    warmup_type: WarmupType = "log"
    last_batch_iteration: LastIteration = -1


class WarmupDecayLRParams(WarmupLRParams):
    """`total_num_steps` may be at or below `warmup_num_steps`, as in DeepSpeed: the lr
    then drops to `warmup_min_lr` when the warmup ends (the scheduler warns)."""

    warmup_max_lr: NonNegFloat = 0.001  # DeepSpeed's WarmupDecayLR default
    total_num_steps: PosInt = Field(description="the step where lr reaches its minimum")


class WarmupCosineLRParams(Section):
    """`total_num_steps` may be at or below `warmup_num_steps`, as in DeepSpeed: the lr
    then stays at `cos_min_ratio` once the warmup ends (the scheduler warns)."""

    total_num_steps: PosInt = Field(description="the step where the cosine reaches its minimum")
    warmup_min_ratio: UnitFloat = 0.0
    warmup_num_steps: PosInt = 1000
    cos_min_ratio: UnitFloat = 0.0001
    warmup_type: WarmupType = "log"
    last_batch_iteration: LastIteration = -1


SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}


class SchedulerConfig(Section):
    """`params` is stored validated, with every default filled in."""

    type: Annotated[
        Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"], choice(tuple(SCHEDULER_PARAMS))
    ] = Field(description="one of 'WarmupLR', 'WarmupDecayLR' or 'WarmupCosineLR'")
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_params(self) -> SchedulerConfig:
        object.__setattr__(
            self, "params", validated_params(SCHEDULER_PARAMS[self.type], self.params)
        )
        return self
