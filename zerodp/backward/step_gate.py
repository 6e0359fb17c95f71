"""Whether the optimizer may step: the gradient state, and the checks made before a step.

`engine.step()`, `engine.zero_grad()` and the optimizer users get back
(`optimizer.step()`, `optimizer.zero_grad()`) all ask this one object, so the
rule is written once and control flows one way: callers -> gate -> reducer.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable

from zerodp.backward import autograd_api
from zerodp.backward.lifecycle import BackwardLifecycle, GraphTask
from zerodp.backward.reducer import GradientReducer
from zerodp.errors import LifecycleError


class GradientState(enum.Enum):
    """What the kept gradients hold, as far as `step()` is concerned.

    CLEAN: zeroed, no backward finished since (a step now has nothing to apply).
    ACCUMULATED: every backward since the last `zero_grad()` finished.
    INCOMPLETE: a backward raised part-way; `zero_grad()` is needed before a step.
    """

    CLEAN = "clean"
    ACCUMULATED = "accumulated"
    INCOMPLETE = "incomplete"


class StepGate:
    """Owns the `GradientState` and the checks that guard `step()` and `zero_grad()`."""

    def __init__(
        self,
        lifecycle: BackwardLifecycle,
        reducer: GradientReducer,
        release_gathered: Callable[[], None],
    ) -> None:
        self.lifecycle = lifecycle
        self.reducer = reducer
        self.release_gathered = release_gathered
        self.state = GradientState.CLEAN
        self._warned_clean_step = False

    # -- transitions, driven by the lifecycle --------------------------------------------

    def on_task_end(self, task: GraphTask) -> None:
        if self.state is GradientState.CLEAN:
            self.state = GradientState.ACCUMULATED

    def on_task_abort(self, task: GraphTask) -> None:
        self.state = GradientState.INCOMPLETE

    # -- what callers ask ------------------------------------------------------------

    def ensure_no_stale_backward(self) -> None:
        """Abort a backward that ended in an exception (its epilogue will never come)."""
        self.lifecycle.abort_if_stale()

    def check_outside_backward(self, what: str) -> None:
        self.ensure_no_stale_backward()
        if autograd_api.in_backward():
            raise LifecycleError(
                f"{what} was called inside a backward (from a hook?); call it after backward "
                "has returned"
            )

    def check_can_step(self) -> None:
        self.check_outside_backward("step()")
        if self.state is GradientState.INCOMPLETE:
            raise LifecycleError(
                "a backward raised part-way, so the gradients are incomplete; call "
                "engine.zero_grad() and run the backward again before step()"
            )

    def warn_if_nothing_to_apply(self) -> None:
        """An optimizer step with no backward since the last one still moves momentum."""
        if self.state is GradientState.CLEAN and not self._warned_clean_step:
            self._warned_clean_step = True
            warnings.warn(
                "optimizer step with no backward since the last step (or zero_grad): the "
                "gradients are zero, but optimizers with momentum (Adam, SGD with momentum) "
                "still move the weights; run a backward before each step",
                stacklevel=4,
            )

    def zero_grad(self) -> None:
        """Zero the kept gradients; release what a forward kept gathered for its backward."""
        self.check_outside_backward("zero_grad()")
        self.reducer.zero()
        self.release_gathered()  # the backward it was kept for may never come
        self.state = GradientState.CLEAN
