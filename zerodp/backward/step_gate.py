"""Whether the optimizer may step: the gradient state, and the checks made before a step.

`engine.step()`, `engine.zero_grad()` and the optimizer users get back
(`optimizer.step()`, `optimizer.zero_grad()`) all ask this one object, so the
rule is written once and control flows one way: callers -> gate -> reducer.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable

import torch

from zerodp.backward import autograd_api
from zerodp.backward.lifecycle import BackwardLifecycle, GraphTask
from zerodp.backward.reducer import GradientReducer
from zerodp.errors import LifecycleError, NonFiniteError, UsageError


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
        on_non_finite: str = "warn",
    ) -> None:
        self.lifecycle = lifecycle
        self.reducer = reducer
        self.release_gathered = release_gathered
        self.on_non_finite = on_non_finite
        self.state = GradientState.CLEAN
        self.non_finite_steps = 0  # optimizer steps whose gradient norm was inf or NaN
        self._pending_norm: tuple[torch.Tensor, int] | None = None  # "warn": read next step
        self._warned_empty_step = False  # one warning, for either kind of empty step
        self._backward_since_step = False
        self._last_step_had_backward = False
        self._closed = False
        # Asked before a step, a zero_grad or an engine.backward(): each returns why the
        # call is refused now (an inference engine, states offloaded), or None.
        self._refusals: list[Callable[[str], str | None]] = []

    # -- transitions, driven by the lifecycle --------------------------------------------

    def on_task_end(self, task: GraphTask) -> None:
        if self.state is GradientState.CLEAN:
            self.state = GradientState.ACCUMULATED
        self._backward_since_step = True

    def on_gradients_loaded(self) -> None:
        """A checkpoint load filled the kept gradients (a window's accumulation so far)."""
        self.state = GradientState.ACCUMULATED
        self.reducer.show_param_grads()

    def on_load(self) -> None:
        """A checkpoint load replaced the state: no step has consumed a backward yet."""
        self._backward_since_step = False
        self._last_step_had_backward = False

    def close(self) -> None:
        """`destroy()` ran: every later call is refused."""
        self._closed = True

    def gradients_held(self) -> bool:
        """Whether the kept gradients hold an accumulation (what a checkpoint must keep)."""
        if self.state is GradientState.INCOMPLETE:
            raise LifecycleError(
                "a backward raised part-way, so the gradients are incomplete and cannot be "
                "saved; call engine.zero_grad() (and rerun the backward) before saving"
            )
        return self.state is GradientState.ACCUMULATED

    def on_task_abort(self, task: GraphTask) -> None:
        self.state = GradientState.INCOMPLETE

    # -- what callers ask ------------------------------------------------------------

    def ensure_no_stale_backward(self, what: str = "this call") -> None:
        """Abort a backward that ended in an exception (its epilogue will never come).

        Every engine call passes here, so it also refuses calls after `destroy()`.
        """
        if self._closed:
            raise LifecycleError(
                f"{what} after engine.destroy(): the engine has released its hooks and "
                "buffers; build a new engine with zerodp.initialize (the module itself stays "
                "usable)"
            )
        self.lifecycle.abort_if_stale()

    def add_refusal(self, refuse: Callable[[str], str | None]) -> None:
        """Ask `refuse(what)` before every guarded call (for the engine's lifetime)."""
        self._refusals.append(refuse)

    def refuse_if_blocked(self, what: str) -> None:
        """Raise `UsageError` if a refusal applies to `what` ("step()", "zero_grad()", ...)."""
        for refuse in self._refusals:
            message = refuse(what)
            if message is not None:
                raise UsageError(message)

    def check_idle(self, what: str) -> None:
        """Outside any backward, and not refused now (a checkpoint save or load)."""
        self.check_outside_backward(what)
        self.refuse_if_blocked(what)

    def check_outside_backward(self, what: str) -> None:
        self.ensure_no_stale_backward(what)
        if autograd_api.in_backward():
            raise LifecycleError(
                f"{what} was called inside a backward (from a hook?); call it after backward "
                "has returned"
            )

    def check_can_step(self) -> None:
        """Refuse a step that would repeat the last one; warn once about a step with no
        backward at all. Passing counts as the step (the caller takes it now)."""
        self.check_outside_backward("step()")
        self.refuse_if_blocked("step()")
        if self.state is GradientState.INCOMPLETE:
            raise LifecycleError(
                "a backward raised part-way, so the gradients are incomplete; call "
                "engine.zero_grad() and run the backward again before step()"
            )
        if not self._backward_since_step:
            if self._last_step_had_backward:
                raise LifecycleError(
                    "step() called twice after one backward: the second call would apply "
                    "the same gradients again (or, at the next micro-step, count a "
                    "micro-batch that never ran); call engine.step() once per backward, "
                    "and not optimizer.step() as well"
                )
            self._warn_empty_step(
                "step() with no backward since the last step: it steps anyway (as "
                "DeepSpeed does), which still moves the weights of optimizers with "
                "momentum; run a backward before each step"
            )
        self._last_step_had_backward = self._backward_since_step
        self._backward_since_step = False

    def warn_if_nothing_to_apply(self) -> None:
        """An optimizer step with no backward since the last one still moves momentum."""
        if self.state is GradientState.CLEAN:
            self._warn_empty_step(
                "optimizer step with no backward since the last step (or zero_grad): the "
                "gradients are zero, but optimizers with momentum (Adam, SGD with momentum) "
                "still move the weights; run a backward before each step"
            )

    def _warn_empty_step(self, message: str) -> None:
        """Once per engine, whichever way a step came to have nothing new to apply."""
        if not self._warned_empty_step:
            self._warned_empty_step = True
            warnings.warn(message, stacklevel=5)

    def skip_non_finite(self, norm: torch.Tensor, global_step: int) -> bool:
        """Apply the `on_non_finite` policy to a step's global gradient norm (fp32, bf16).

        The norm is summed over every rank's shard, so every rank reaches the same
        verdict without a collective. True: skip this step (on every rank).

        With the default policy ("warn") nothing waits for the norm: it is read at
        the next step, when the device has long computed it, so a step costs no
        host synchronisation; the warning names the step it is about. "skip" and
        "raise" must decide now, and read the norm at once.
        """
        if self.on_non_finite == "warn":
            self.warn_if_pending_non_finite()
            self._pending_norm = (norm.detach(), global_step)
            return False
        if bool(torch.isfinite(norm).item()):
            return False
        self.non_finite_steps += 1  # (the monitor reports the count at each boundary)
        what = self._describe(norm, global_step)
        if self.on_non_finite == "raise":
            raise NonFiniteError(
                f"{what}; nothing was changed. Lower the learning rate, check the data of "
                "this step, or set on_non_finite to 'skip' to skip such steps"
            )
        warnings.warn(
            f"{what}; the step is skipped on every rank (on_non_finite: skip)", stacklevel=5
        )
        return True

    def warn_if_pending_non_finite(self) -> None:
        """ "warn": report the last step's norm if it was not finite (read now, without a stall)."""
        pending, self._pending_norm = self._pending_norm, None
        if pending is None:
            return
        norm, global_step = pending
        if bool(torch.isfinite(norm).item()):
            return
        self.non_finite_steps += 1  # (the monitor reports the count at each boundary)
        warnings.warn(
            f"{self._describe(norm, global_step)}; the weights become non-finite; set "
            "on_non_finite to 'skip' or 'raise'",
            stacklevel=5,
        )

    @staticmethod
    def _describe(norm: torch.Tensor, global_step: int) -> str:
        return (
            f"optimizer step {global_step + 1}: the gradient norm is {float(norm.item())} (a "
            "non-finite loss, or an overflow in the backward)"
        )

    def zero_grad(self) -> None:
        """Zero the kept gradients; release what a forward kept gathered for its backward."""
        self.check_outside_backward("zero_grad()")
        self.refuse_if_blocked("zero_grad()")
        self.reducer.zero()
        self.release_gathered()  # the backward it was kept for may never come
        self.state = GradientState.CLEAN
