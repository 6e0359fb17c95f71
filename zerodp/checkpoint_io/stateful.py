"""JSON adapters for the torch objects a checkpoint saves: optimizer settings, LR scheduler."""

from __future__ import annotations

from typing import Any

import torch

from zerodp.checkpoint_io.jsonable import from_jsonable, to_jsonable
from zerodp.checkpoint_io.schema import check_like
from zerodp.errors import CheckpointError


class OptimizerSettings:
    """The torch optimizer's class and param-group settings (lr, betas, ...), not its tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        groups = [
            to_jsonable({k: v for k, v in group.items() if k != "params"})
            for group in self.optimizer.param_groups
        ]
        return {"class": _class_label(self.optimizer), "param_groups": groups}

    def check_state_dict(self, state: Any) -> None:
        """The same optimizer class, param-group count and hyperparameter names, and values
        of the types this optimizer holds (checked before anything is loaded)."""
        groups = state.get("param_groups") if isinstance(state, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise CheckpointError(
                "checkpoint optimizer settings: expected a list of param-group objects; the "
                "checkpoint's zerodp_state.json is damaged"
            )
        saved_class, current_class = state.get("class"), _class_label(self.optimizer)
        if saved_class != current_class:
            raise CheckpointError(
                f"the checkpoint was saved with optimizer {saved_class}, this engine uses "
                f"{current_class}: its state and settings do not carry over; build the engine "
                f"with {saved_class}, or pass load_optimizer_states=False to load the weights "
                "and counters only (the optimizer starts afresh)"
            )
        current = self.optimizer.param_groups
        if len(groups) != len(current):
            raise CheckpointError(
                f"the checkpoint has {len(groups)} optimizer param groups, the engine "
                f"{len(current)}; build the optimizer with the same param groups, or pass "
                "load_optimizer_states=False to load the weights only"
            )
        for index, (saved, live) in enumerate(zip(groups, current, strict=True)):
            names = sorted(set(_group_defaults(self.optimizer, index)) - {"params"})
            missing = [name for name in names if name not in saved]
            if missing:
                raise CheckpointError(
                    f"checkpoint optimizer param group {index} lacks the {current_class} "
                    f"hyperparameters {missing}; the checkpoint's zerodp_state.json is damaged, "
                    "or pass load_optimizer_states=False"
                )
            for key, value in live.items():
                if key != "params" and key in saved:
                    check_like(
                        saved[key], to_jsonable(value), f"optimizer param group {index} '{key}'"
                    )
            lr = saved.get("lr")
            if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr < 0:
                raise CheckpointError(
                    f"checkpoint optimizer param group {index}: lr {lr} is negative; the "
                    "checkpoint's zerodp_state.json is damaged"
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            for key, value in saved.items():
                group[key] = from_jsonable(value)


def _check_deepspeed_schedule(scheduler: Any, iteration: Any) -> None:
    """DeepSpeed's `{"last_batch_iteration": t}` fits DeepSpeed's schedules only (zerodp's
    WarmupLR, WarmupDecayLR, WarmupCosineLR), which recompute every lr from t."""
    if not hasattr(scheduler, "last_batch_iteration"):
        raise CheckpointError(
            f"the checkpoint's LR scheduler state is a DeepSpeed schedule's (last_batch_iteration "
            f"{iteration!r}), which {type(scheduler).__name__} cannot take; configure the same "
            "DeepSpeed schedule (WarmupLR, WarmupDecayLR or WarmupCosineLR), or pass "
            "load_lr_scheduler_states=False"
        )
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < -1:
        raise CheckpointError(
            f"checkpoint lr_scheduler: last_batch_iteration is {iteration!r}, not an integer "
            ">= -1; the checkpoint's zerodp_state.json is damaged"
        )


def _class_label(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class, or its members' classes ("Muon+AdamW") for several optimizers
    stepped as one (`zerodp.optim.torch_optimizers.OptimizerChain`)."""
    return str(getattr(optimizer, "class_label", type(optimizer).__name__))


def _group_defaults(optimizer: torch.optim.Optimizer, index: int) -> dict[str, Any]:
    """The hyperparameter defaults of the optimizer that steps param group `index`."""
    per_group = getattr(optimizer, "group_defaults", None)
    return dict(per_group(index)) if callable(per_group) else dict(optimizer.defaults)


class SchedulerState:
    """A torch LR scheduler's state, as JSON (tensors become numbers, tuples are marked)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> Any:
        return to_jsonable(self.scheduler.state_dict())

    def check_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise CheckpointError(
                f"checkpoint lr_scheduler: expected a JSON object, got {type(state).__name__}; "
                "the checkpoint's zerodp_state.json is damaged"
            )
        if set(state) == {"last_batch_iteration"}:  # a DeepSpeed schedule's (`zerodp convert`)
            _check_deepspeed_schedule(self.scheduler, state["last_batch_iteration"])
            return
        check_like(state, self.state_dict(), "checkpoint lr_scheduler")

    def load_state_dict(self, state: Any) -> None:
        self.check_state_dict(state)
        self.scheduler.load_state_dict(from_jsonable(state))
