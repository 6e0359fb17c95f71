"""Training or inference: what an engine is for, decided once at `zerodp.initialize`.

An engine with nothing to train is an inference engine (see [Note: inference
engine] in `zerodp.posttrain`): the model has no parameter that requires grad,
or no optimizer was named (none passed to `initialize`, no `optimizer` block in
the config). It keeps the stage's parameter layout (sharded at stage 3), builds
no kept gradient, no optimizer state and no scheduler, and refuses
`engine.backward()` and `step()` with a message that names the fix.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerodp.errors import UsageError


class EngineMode(enum.Enum):
    """TRAINING: backward and step as usual. INFERENCE: forward (and generation) only."""

    TRAINING = "training"
    INFERENCE = "inference"


class InferenceReason(enum.Enum):
    """Why an engine is for inference: the error messages say which applies."""

    ALL_FROZEN = "every parameter of the model has requires_grad=False"
    NO_OPTIMIZER = (
        "it was built without an optimizer (none passed to zerodp.initialize, no "
        "'optimizer' block in the config)"
    )


@dataclass(frozen=True)
class ModeDecision:
    mode: EngineMode
    reason: InferenceReason | None = None

    @property
    def trains(self) -> bool:
        return self.mode is EngineMode.TRAINING


def decide_mode(module: nn.Module, config_optimizer: Any, user_optimizer: Any) -> ModeDecision:
    """Inference when no parameter requires grad, or when no optimizer is named anywhere."""
    if not any(p.requires_grad for p in module.parameters()):
        return ModeDecision(EngineMode.INFERENCE, InferenceReason.ALL_FROZEN)
    if user_optimizer is None and config_optimizer is None:
        return ModeDecision(EngineMode.INFERENCE, InferenceReason.NO_OPTIMIZER)
    return ModeDecision(EngineMode.TRAINING)


class FrozenByEngine:
    """Parameters an inference engine froze (requires_grad=False); `remove()` unfreezes them.

    Without an optimizer nothing would apply their gradients, and a backward would
    leave an unreduced local `.grad` on each rank; frozen, a backward through the
    model computes input gradients only (the model may sit inside another model's
    loss). `engine.destroy()` calls `remove()`, so the module is as it was.
    """

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        for param in self.params:
            param.requires_grad_(False)

    def remove(self) -> None:
        for param in self.params:
            param.requires_grad_(True)
        self.params = []


class InferenceOptimizer(torch.optim.Optimizer):
    """The torch optimizer of an inference engine: no parameters, no state, never steps.

    The engine's parts (its `ZeroOptimizer`, checkpoints, the loss scaler) stay one
    shape for both modes; `zerodp.initialize` returns None in its place, as DeepSpeed
    does for an engine without an optimizer.
    """

    def __init__(self, refusal: str) -> None:
        super().__init__([{"params": []}], {})
        self._refusal = refusal

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        raise UsageError(self._refusal)


def refusal_message(decision: ModeDecision, what: str) -> str:
    """What `what` (e.g. "engine.backward()") says on an inference engine."""
    reason = decision.reason.value if decision.reason is not None else "it trains nothing"
    return (
        f"{what} on an inference engine: {reason}. It runs forward passes and generation "
        "only (a backward through it reaches its inputs, never its weights). To train this "
        "model, give it trainable parameters and an optimizer (optimizer= to "
        "zerodp.initialize, or an 'optimizer' block in the config)"
    )
