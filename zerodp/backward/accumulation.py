"""The accumulation window, and the factors every backward's gradients carry.

[Note: gradient factors]
A kept gradient carries, for every backward that added to it, the factor
1 / gradient_accumulation_steps (so a window of micro-batches averages, as in
DeepSpeed) and, under fp16, the loss scale (divided out again by the step).
Where each factor is applied is chosen so that it cannot depend on how a loss
was built:

- 1 / steps is applied to each gradient as it arrives (`contribution_factor`),
  for every graph task, however backward was called. So
  `(engine.scale(a) + b).backward()`, `loss.backward()` and
  `engine.backward(loss)` all divide every part of the gradient alike.
  `engine.backward(loss, scale_wrt_gas=False)` owns its whole task (the loss is
  the task's root), so it can say so for that task (`rooted_at`).
- The fp16 loss scale must multiply the loss itself (that is what keeps small
  gradients from underflowing). `engine.scale(loss)` returns a `ScaledLoss`:
  running backward from it marks the task as rooted at a scaled loss, so its
  gradients carry the scale already. A task rooted anywhere else gets the
  scale applied to its gradients as they arrive (exact, without underflow
  protection). A `ScaledLoss` reached inside a task rooted elsewhere (a scaled
  and an unscaled loss summed) would leave part of the gradient unscaled, so
  its hook raises `UsageError` naming the fix: detected every time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zerodp.errors import UsageError
from zerodp.train_state import TrainState


@dataclass(frozen=True)
class TaskRoot:
    """What a backward call knows about the loss it starts from."""

    scaled: bool  # the loss carries the fp16 loss scale (it came from engine.scale())
    divided: bool  # its gradients are divided by the accumulation steps


_PLAIN_ROOT = TaskRoot(scaled=False, divided=True)


class AccumulationWindow:
    """The micro-batches one optimizer step averages, and where the running window stands.

    The backward prologue reads it (`task_reduces`, `contribution_factor`); the
    engine moves it (`step()` counts micro-steps in `counters`,
    `set_gradient_accumulation_boundary` overrides the count, `no_sync()` nests).
    """

    def __init__(self, steps: int, counters: TrainState, loss_scale: Callable[[], float]) -> None:
        self.steps = steps
        self.counters = counters
        self._loss_scale = loss_scale
        self.boundary_override: bool | None = None
        self.no_sync_depth = 0
        self._root: TaskRoot | None = None  # set while a backward call with a known root runs

    def is_boundary(self) -> bool:
        """Whether the next `step()` steps the optimizer.

        Counted from the micro-steps, unless `set_gradient_accumulation_boundary()` decided.
        """
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.counters.micro_steps + 1) % self.steps == 0

    def task_reduces(self) -> bool:
        """Whether a backward starting now is the window's last (its sums are reduced)."""
        return self.is_boundary() and self.no_sync_depth == 0

    @contextlib.contextmanager
    def rooted_at(self, root: TaskRoot) -> Iterator[None]:
        """While a backward call runs whose root loss is known: its task is `root`'s."""
        previous, self._root = self._root, root
        try:
            yield
        finally:
            self._root = previous

    def begin_task(self) -> TaskRoot:
        """The root of the task starting now (read by the prologue, once per task)."""
        return self._root or _PLAIN_ROOT

    def contribution_factor(self, root: TaskRoot) -> float:
        """What a task's gradients are multiplied by on their way into the kept gradients."""
        factor = 1.0 / self.steps if root.divided else 1.0
        return factor if root.scaled else factor * self._loss_scale()

    def scale(self, loss: torch.Tensor, *, divided: bool) -> torch.Tensor:
        """`loss` as backward should start from it (see [Note: gradient factors])."""
        scale = self._loss_scale()
        if scale == 1.0 and divided:
            return loss  # every factor is applied as gradients arrive
        scaled = loss * scale if scale != 1.0 else loss.view_as(loss)
        root = ScaledLoss.wrap(scaled, self, TaskRoot(scaled=True, divided=divided))
        if root.requires_grad:
            root.register_hook(self._check_root)
        return root

    def _check_root(self, grad: torch.Tensor) -> None:
        root = self._root
        if root is None or not root.scaled:
            raise UsageError(
                "a loss returned by engine.scale() was reached by a backward that started "
                "from another tensor (e.g. (engine.scale(a) + b).backward(), or "
                "torch.autograd.backward(engine.scale(a))): part of the gradient could miss "
                "the factors engine.scale() applies (the fp16 loss scale, or "
                "scale_wrt_gas=False). Call .backward() on the scaled loss itself "
                "(engine.scale(a + b).backward()), or engine.backward(a + b)"
            )


class ScaledLoss(torch.Tensor):
    """A loss from `engine.scale()`: its `backward()` tells the window where the task starts.

    Operations on it give plain tensors (torch-function dispatch is off), so a sum
    of it and another loss is not a `ScaledLoss`, and its backward is not marked.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _window: AccumulationWindow
    _root: TaskRoot

    @classmethod
    def wrap(cls, loss: torch.Tensor, window: AccumulationWindow, root: TaskRoot) -> ScaledLoss:
        wrapped = loss.as_subclass(cls)
        wrapped._window = window
        wrapped._root = root
        return wrapped

    def backward(self, *args: Any, **kwargs: Any) -> None:
        with self._window.rooted_at(self._root):
            super().backward(*args, **kwargs)
