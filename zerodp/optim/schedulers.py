"""DeepSpeed's warmup learning-rate schedules as plain torch `LRScheduler`s.

Subclassing torch's scheduler keeps `state_dict`/`load_state_dict`,
`get_last_lr()` and the optimizer-step bookkeeping that users and checkpoint
code already rely on. Each schedule is a closed form in the step count, so a
resumed run computes exactly the lr an uninterrupted run would have.

Step count `t` is the number of `scheduler.step()` calls so far: torch's
constructor takes one step itself, so the lr right after construction is the
`t = 0` value. `last_batch_iteration` is torch's `last_epoch`: passing `k`
resumes at `t = k + 1`, and -1 starts fresh.

Constructor arguments are validated with the same models as the config's
`scheduler.params`, so a bad value raises the same `ConfigError` either way.
"""

from __future__ import annotations

import math

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zerodp.config.model import (
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from zerodp.errors import ConfigError

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]


def warmup_fraction(t: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far warmup has progressed at step `t`, from 0 to 1.

    "log" rises quickly at first: log(t + 1) / log(warmup_num_steps);
    "linear" is t / warmup_num_steps. Both are 1 once t >= warmup_num_steps,
    and a one-step "log" warmup is 1 from the start (log(1) / log(1) is 0/0).
    """
    if t >= warmup_num_steps:
        return 1.0
    if warmup_type == "linear":
        return t / warmup_num_steps
    if warmup_num_steps == 1:
        return 1.0
    return math.log(t + 1) / math.log(warmup_num_steps)


def _keep_initial_lr(optimizer: Optimizer) -> None:
    """Let WarmupLR/WarmupDecayLR resume without `initial_lr`, which they never read.

    torch insists on `initial_lr` in every group when `last_epoch >= 0`; these
    two schedules ignore the optimizer's lr, so any value satisfies it.
    """
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])


class _MinToMaxSchedule(LRScheduler):
    """Shared body of WarmupLR and WarmupDecayLR: lr = min + (max - min) * gamma(t)."""

    warmup_min_lr: float
    warmup_max_lr: float
    warmup_num_steps: int
    warmup_type: str

    def _start(self, optimizer: Optimizer, p: WarmupLRParams) -> None:
        self.warmup_min_lr = p.warmup_min_lr
        self.warmup_max_lr = p.warmup_max_lr
        self.warmup_num_steps = p.warmup_num_steps
        self.warmup_type = p.warmup_type
        _keep_initial_lr(optimizer)
        super().__init__(optimizer, last_epoch=p.last_batch_iteration)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name for the step count torch calls `last_epoch`."""
        return self.last_epoch

    def _gamma(self, t: int) -> float:
        return warmup_fraction(t, self.warmup_num_steps, self.warmup_type)

    def get_lr(self) -> list[float | Tensor]:
        gamma = self._gamma(self.last_epoch)
        lr = self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * gamma
        return [lr for _ in self.optimizer.param_groups]


class WarmupLR(_MinToMaxSchedule):
    """Warm up from `warmup_min_lr` to `warmup_max_lr`, then hold.

    lr(t) = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma(t), with
    gamma(t) = log(t + 1) / log(warmup_num_steps) ("log") or
    t / warmup_num_steps ("linear") while t < warmup_num_steps, else 1.
    Every param group gets the same lr; the optimizer's own lr is ignored.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        p = WarmupLRParams.from_dict(
            {
                "warmup_min_lr": warmup_min_lr,
                "warmup_max_lr": warmup_max_lr,
                "warmup_num_steps": warmup_num_steps,
                "warmup_type": warmup_type,
                "last_batch_iteration": last_batch_iteration,
            }
        )
        self._start(optimizer, p)


class WarmupDecayLR(_MinToMaxSchedule):
    """WarmupLR, then a linear decay that reaches `warmup_min_lr` at `total_num_steps`.

    lr(t) = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma(t), where
    gamma(t) is WarmupLR's warmup fraction while t < warmup_num_steps and
    afterwards max(0, (total_num_steps - t) / (total_num_steps - warmup_num_steps)).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        p = WarmupDecayLRParams.from_dict(
            {
                "total_num_steps": total_num_steps,
                "warmup_min_lr": warmup_min_lr,
                "warmup_max_lr": warmup_max_lr,
                "warmup_num_steps": warmup_num_steps,
                "warmup_type": warmup_type,
                "last_batch_iteration": last_batch_iteration,
            }
        )
        self.total_num_steps = p.total_num_steps
        self._start(optimizer, p)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return super()._gamma(t)
        decay_steps = self.total_num_steps - self.warmup_num_steps
        return max(0.0, (self.total_num_steps - t) / decay_steps)


class WarmupCosineLR(LRScheduler):
    """Warm up to each group's own lr, then follow a cosine down to a fraction of it.

    lr(t) = initial_lr * ratio(t), where initial_lr is the group's lr when the
    scheduler was created. While t < warmup_num_steps,
    ratio = warmup_min_ratio + (1 - warmup_min_ratio) * w(t) with w(t) the
    "log" or "linear" warmup fraction of WarmupLR. Afterwards, with
    progress = clip((t - warmup_num_steps) / (total_num_steps - warmup_num_steps), 0, 1),
    ratio = cos_min_ratio + (1 - cos_min_ratio) * 0.5 * (1 + cos(pi * progress)).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        p = WarmupCosineLRParams.from_dict(
            {
                "total_num_steps": total_num_steps,
                "warmup_min_ratio": warmup_min_ratio,
                "warmup_num_steps": warmup_num_steps,
                "cos_min_ratio": cos_min_ratio,
                "warmup_type": warmup_type,
                "last_batch_iteration": last_batch_iteration,
            }
        )
        self.total_num_steps = p.total_num_steps
        self.warmup_min_ratio = p.warmup_min_ratio
        self.warmup_num_steps = p.warmup_num_steps
        self.cos_min_ratio = p.cos_min_ratio
        self.warmup_type = p.warmup_type
        if p.last_batch_iteration >= 0 and any(
            "initial_lr" not in group for group in optimizer.param_groups
        ):
            # The peak lr would otherwise be taken from an already decayed lr.
            raise ConfigError(
                f"WarmupCosineLR last_batch_iteration: got {p.last_batch_iteration}, but the "
                "optimizer's param groups have no 'initial_lr' (the peak lr); load the "
                "optimizer state saved with the scheduler first, or construct the scheduler "
                "with last_batch_iteration=-1 and call load_state_dict"
            )
        super().__init__(optimizer, last_epoch=p.last_batch_iteration)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name for the step count torch calls `last_epoch`."""
        return self.last_epoch

    def _ratio(self, t: int) -> float:
        if t < self.warmup_num_steps:
            w = warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * w
        span = self.total_num_steps - self.warmup_num_steps
        progress = min(1.0, max(0.0, (t - self.warmup_num_steps) / span))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine

    def get_lr(self) -> list[float | Tensor]:
        ratio = self._ratio(self.last_epoch)
        return [base_lr * ratio for base_lr in self.base_lrs]


_CLASSES: dict[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_scheduler(optimizer: Optimizer, cfg: SchedulerConfig) -> LRScheduler:
    """The scheduler `cfg` names, attached to `optimizer`."""
    return _CLASSES[cfg.type](optimizer, **cfg.params)
