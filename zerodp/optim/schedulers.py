"""DeepSpeed's warmup learning-rate schedules as plain torch `LRScheduler`s.

Subclassing torch's scheduler keeps `state_dict`/`load_state_dict`,
`get_last_lr()` and the optimizer-step bookkeeping that users and checkpoint
code already rely on. Each schedule is a closed form in DeepSpeed's
`last_batch_iteration` t, so a resumed run computes exactly the lr an
uninterrupted run would have, and the lr of every step is DeepSpeed 0.19.8's
(tests/unit/test_schedulers.py compares with values DeepSpeed produced).

DeepSpeed counts t from -1: its constructor sets the lr for t = -1 (the
first optimizer step uses it) and each `step()` adds one. torch's
`last_epoch` starts at 0 after construction, so here t = last_epoch - 1:
the n-th optimizer step (counting from 1) uses lr(t = n - 2), and lr(-1) is
the warmup's start (0 for WarmupCosineLR, as in DeepSpeed). As in DeepSpeed,
a warmup shorter than 2 steps counts as 2. Passing `last_batch_iteration=k`
(or loading DeepSpeed's state dict `{"last_batch_iteration": k}`) resumes
where a DeepSpeed run saved at t = k stood: lr(k) now, lr(k + 1) after the
next step.

Constructor arguments are validated with the same models as the config's
`scheduler.params`, so a bad value raises the same `ConfigError` either way.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zerodp.config.model import (
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from zerodp.errors import ConfigError, ConfigWarning

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]

_DEEPSPEED_STATE_KEYS = {"last_batch_iteration"}


def warmup_fraction(t: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far warmup has progressed at DeepSpeed's iteration `t`, from 0 to 1.

    "log" rises quickly at first: log(t + 1) / log(n); "linear" is t / n;
    both are 1 once t >= n, with n = max(2, warmup_num_steps) as in DeepSpeed,
    and 0 before the first step (t = -1).
    """
    n = max(2, warmup_num_steps)
    if t >= n:
        return 1.0
    if t < 0:
        return 0.0
    if warmup_type == "linear":
        return t / n
    return (1.0 / math.log(n)) * math.log(t + 1)  # DeepSpeed's order of operations, to the bit


def _warn_if_no_decay(name: str, total_num_steps: int, warmup_num_steps: int) -> None:
    """DeepSpeed accepts a decay that ends before its warmup does, and warns; so does zerodp.

    The lr then goes from the warmup straight to the schedule's minimum.
    """
    if total_num_steps < max(2, warmup_num_steps):
        warnings.warn(
            f"{name}: total_num_steps {total_num_steps} is less than warmup_num_steps "
            f"{warmup_num_steps}: the lr drops to the schedule's minimum when the warmup ends "
            "(as in DeepSpeed); raise total_num_steps or lower warmup_num_steps if that is not "
            "what you want",
            ConfigWarning,
            stacklevel=3,
        )


def _keep_initial_lr(optimizer: Optimizer) -> None:
    """Let WarmupLR/WarmupDecayLR resume without `initial_lr`, which they never read.

    torch insists on `initial_lr` in every group when `last_epoch >= 0`; these
    two schedules ignore it, so any value satisfies it.
    """
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])


class _DeepSpeedSchedule(LRScheduler):
    """The step counting shared by the three schedules (see the module docstring)."""

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's step count t: -1 before the first scheduler step."""
        return self.last_epoch - 1

    def _lrs(self, t: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float | Tensor]:
        return list(self._lrs(self.last_batch_iteration))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's state dict, or DeepSpeed's `{"last_batch_iteration": t}` (then the
        optimizer's lrs are set to lr(t) at once, as a DeepSpeed run saved at t has them)."""
        if set(state_dict) != _DEEPSPEED_STATE_KEYS:
            super().load_state_dict(state_dict)
            return
        t = state_dict["last_batch_iteration"]
        if isinstance(t, bool) or not isinstance(t, int) or t < -1:
            raise ConfigError(f"last_batch_iteration: got {t!r}; allowed: an integer >= -1")
        self.last_epoch = t + 1
        self._step_count = max(self._step_count, 1)
        lrs = self._lrs(t)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = list(lrs)


class _MinToMaxSchedule(_DeepSpeedSchedule):
    """Shared body of WarmupLR and WarmupDecayLR: lr = min + (max - min) * gamma(t)."""

    warmup_min_lr: float
    warmup_max_lrs: list[float]
    warmup_num_steps: int
    warmup_type: str

    def _start(self, optimizer: Optimizer, p: WarmupLRParams) -> None:
        self.warmup_min_lr = p.warmup_min_lr
        self.warmup_max_lrs = [
            float(group["lr"]) if p.warmup_max_lr is None else p.warmup_max_lr
            for group in optimizer.param_groups
        ]
        self.warmup_num_steps = p.warmup_num_steps
        self.warmup_type = p.warmup_type
        _keep_initial_lr(optimizer)
        super().__init__(optimizer, last_epoch=p.last_batch_iteration)

    @property
    def warmup_max_lr(self) -> float:
        return self.warmup_max_lrs[0]

    def _gamma(self, t: int) -> float:
        return warmup_fraction(t, self.warmup_num_steps, self.warmup_type)

    def _lrs(self, t: int) -> list[float]:
        gamma = self._gamma(t)
        low = self.warmup_min_lr
        return [low + (high - low) * gamma for high in self.warmup_max_lrs]


class WarmupLR(_MinToMaxSchedule):
    """Warm up from `warmup_min_lr` to `warmup_max_lr` (default: each group's own lr), then hold.

    lr(t) = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma(t), with
    gamma(t) = log(t + 1) / log(n) ("log") or t / n ("linear") while t < n,
    else 1 (n = max(2, warmup_num_steps); t = -1 before the first step).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
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
    gamma(t) is WarmupLR's warmup fraction while t < n = max(2, warmup_num_steps)
    and afterwards max(0, (total_num_steps - t) / (total_num_steps - n)).
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
        _warn_if_no_decay("WarmupDecayLR", p.total_num_steps, p.warmup_num_steps)
        self._start(optimizer, p)

    def _gamma(self, t: int) -> float:
        n = max(2, self.warmup_num_steps)
        if t < n:
            return super()._gamma(t)
        return max(0.0, (self.total_num_steps - t) / max(1, self.total_num_steps - n))


class WarmupCosineLR(_DeepSpeedSchedule):
    """Warm up to each group's own lr, then follow a cosine down to a fraction of it.

    lr(t) = initial_lr * ratio(t), where initial_lr is the group's lr when the
    scheduler was created, and 0 before the first step (t = -1). While
    t < n = max(2, warmup_num_steps), ratio = warmup_min_ratio +
    (1 - warmup_min_ratio) * w(t) with w(t) WarmupLR's warmup fraction.
    Afterwards, with progress = min(1, (t - n + 1) / max(1, total_num_steps - n)),
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
        _warn_if_no_decay("WarmupCosineLR", p.total_num_steps, p.warmup_num_steps)
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

    def _ratio(self, t: int) -> float:
        if t < 0:
            return 0.0
        n = max(2, self.warmup_num_steps)
        if t < n:
            w = warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * w
        progress = min(1.0, (t - n + 1) / max(1, self.total_num_steps - n))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs(self, t: int) -> list[float]:
        ratio = self._ratio(t)
        return [float(base_lr) * ratio for base_lr in self.base_lrs]


_CLASSES: dict[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def build_scheduler(optimizer: Optimizer, cfg: SchedulerConfig) -> LRScheduler:
    """The scheduler `cfg` names, attached to `optimizer`."""
    return _CLASSES[cfg.type](optimizer, **cfg.params)
