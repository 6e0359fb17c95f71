"""What `ZeroDPTrainer` hands the Trainer as its optimizer and LR scheduler.

The engine steps the real optimizer and scheduler (at its accumulation
boundary, and the scheduler not after an fp16-skipped step); the Trainer's
loop still calls `optimizer.step()`, `lr_scheduler.step()` and
`get_last_lr()`. These views give those calls their meaning under zerodp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zerodp
from zerodp.errors import UsageError


class EngineOptimizer:
    """What the Trainer holds as `self.optimizer`: its `step()` is the engine's boundary step.

    `param_groups` and `state` are the engine optimizer's (this rank's shards).
    `last_step_lr` is the learning rate the last step used, which the Trainer
    logs (the engine has stepped the scheduler by the time it asks).
    """

    def __init__(self, engine: zerodp.ZeroEngine) -> None:
        self.engine = engine
        self.last_step_lr: list[float] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.engine.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise UsageError("zerodp's optimizer step takes no closure")
        self.last_step_lr = self.engine.get_lr()
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (checkpoints hold all of it)."""
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        raise UsageError(
            "zerodp restores the optimizer from its checkpoint (resume_from_checkpoint)"
        )


class EngineScheduler:
    """What the Trainer holds as `self.lr_scheduler`; the engine steps the real one."""

    def __init__(self, optimizer: EngineOptimizer) -> None:
        self._optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the engine stepped the scheduler in its step (not after a skipped one)."""

    def get_last_lr(self) -> list[float]:
        """The learning rate of the last step (the next one's before the first step)."""
        last = self._optimizer.last_step_lr
        return list(last) if last is not None else self._optimizer.engine.get_lr()

    def state_dict(self) -> dict[str, Any]:
        scheduler = self._optimizer.engine.lr_scheduler
        return {} if scheduler is None else dict(scheduler.state_dict())

    def load_state_dict(self, state_dict: Any) -> None:
        raise UsageError(
            "zerodp restores the scheduler from its checkpoint (resume_from_checkpoint)"
        )
