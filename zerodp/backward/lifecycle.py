"""One prologue and one epilogue per autograd graph task.

[Note: backward lifecycle]
A "backward" is one autograd graph task: one `loss.backward()`,
`engine.backward(loss)`, `engine.scale(loss).backward()` or
`torch.autograd.grad(...)`. One forward may be followed by several graph tasks
(`retain_graph=True`), and one task may span several forwards. zerodp never
assumes which call started a backward: every hook autograd fires on zerodp's
behalf (on forward outputs, module inputs, parameters' gradients, forward
hooks re-run by activation checkpointing, saved-tensor unpacking, the loss
`engine.scale()` returns) is registered through `BackwardLifecycle.hook`,
which calls `observe()` before the hook's own work, so no hook can forget to.

- The first hook seen in a new graph task (`current_graph_task_id()`) runs the
  prologue and queues the epilogue with `queue_task_callback`, so autograd
  itself calls it when that task has finished. A retained graph run again is
  a new task with a new id: it gets its own prologue and epilogue.
- A task started from inside a running task's node (reentrant activation
  checkpointing) is part of the enclosing task: it runs deeper in the engine
  (`engine_depth()`), so it is folded into the enclosing task.
- A task that ends in an exception never gets its epilogue from autograd. It
  is found stale, and aborted, by the next hook of a different task at the
  same depth, or by any engine entry point reached outside backward
  (forward, `zero_grad`, `step`, `engine.backward`'s own error path): the
  abort handlers drop what the dead task left (pending reductions, gathered
  parameters) so that nothing carries over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

from zerodp.backward import autograd_api
from zerodp.backward.signals import Signal

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class GraphTask:
    """What zerodp knows of one backward graph task."""

    task_id: int
    sequence: int  # 0 for the first task this engine saw, then 1, 2, ...
    create_graph: bool  # grad mode inside the task: True for create_graph=True
    depth: int


TaskCallback = Callable[[GraphTask], None]


class BackwardLifecycle:
    """Tracks graph tasks and runs the registered prologues, epilogues and aborts.

    A task is running exactly while `task` is not None.
    """

    def __init__(self) -> None:
        self.task: GraphTask | None = None
        self.num_prologues = 0
        self.num_epilogues = 0
        self.num_aborted = 0
        self._prologues: Signal[GraphTask] = Signal()
        self._epilogues: Signal[GraphTask] = Signal()
        self._aborts: Signal[GraphTask] = Signal()
        self._user_prologues: Signal[GraphTask] = Signal()
        self._user_epilogues: Signal[GraphTask] = Signal()

    # -- registration --------------------------------------------------------------

    def on_prologue(self, callback: TaskCallback) -> RemovableHandle:
        return self._prologues.connect(callback)

    def on_epilogue(self, callback: TaskCallback) -> RemovableHandle:
        return self._epilogues.connect(callback)

    def on_abort(self, callback: TaskCallback) -> RemovableHandle:
        return self._aborts.connect(callback)

    def hook(self, fn: Callable[P, R]) -> Callable[P, R]:
        """`fn` as an autograd hook: the lifecycle observes first, then `fn` runs.

        Every hook zerodp gives autograd goes through here; see
        [Note: backward lifecycle].
        """

        def observed(*args: P.args, **kwargs: P.kwargs) -> R:
            self.observe()
            return fn(*args, **kwargs)

        return observed

    def accumulated_grad_hook(
        self, fn: Callable[[torch.Tensor], None]
    ) -> Callable[[torch.Tensor], None]:
        """`fn` as a post-accumulate-grad hook on a parameter, observed as `hook` does.

        It may be the first hook of its task (a backward that reaches a parameter before
        any forward output, such as a forward the engine's hooks did not see). Its
        observation then runs the prologue, which sets every `.grad` to None; the
        gradient autograd has just accumulated is read before and put back after it, so
        one hook per parameter is enough where `.grad` is None between tasks (stages
        1-3; see [Note: gradient reduction]).
        """

        def observed(param: torch.Tensor) -> None:
            grad = param.grad
            self.observe()
            param.grad = grad
            fn(param)

        return observed

    def register_user_hooks(
        self, prologue: TaskCallback | None, epilogue: TaskCallback | None
    ) -> list[RemovableHandle]:
        """User hooks: the prologue runs after zerodp's, the epilogue after zerodp's."""
        handles = []
        if prologue is not None:
            handles.append(self._user_prologues.connect(prologue))
        if epilogue is not None:
            handles.append(self._user_epilogues.connect(epilogue))
        return handles

    # -- the hooks' entry point ------------------------------------------------------

    def observe(self) -> GraphTask | None:
        """Called first by every zerodp hook; returns the task it belongs to (None outside)."""
        task_id = autograd_api.current_graph_task_id()
        if task_id == autograd_api.NO_TASK:
            return None
        task = self.task
        if task is not None:
            if task_id == task.task_id:
                return task
            if autograd_api.engine_depth() > task.depth:
                return task  # a nested (reentrant) task is part of the enclosing one
            self._abort(task)  # the running task died: its epilogue will never come
        return self._start(task_id)

    def abort_if_stale(self) -> bool:
        """From an entry point outside backward: abort a task that ended in an exception."""
        task = self.task
        if task is not None and not autograd_api.in_backward():
            self._abort(task)
            return True
        return False

    @property
    def running(self) -> bool:
        return self.task is not None

    # -- transitions ---------------------------------------------------------------

    def _start(self, task_id: int) -> GraphTask:
        task = GraphTask(
            task_id=task_id,
            sequence=self.num_prologues,
            create_graph=torch.is_grad_enabled(),
            depth=autograd_api.engine_depth(),
        )
        self.task = task
        self.num_prologues += 1
        autograd_api.queue_task_callback(self._finish)
        self._prologues.emit(task)
        self._user_prologues.emit(task)
        return task

    def _finish(self) -> None:
        task = self.task
        if task is None:  # pragma: no cover - aborted from another thread meanwhile
            return
        try:
            self._epilogues.emit(task)
            self._user_epilogues.emit(task)
        finally:
            self.num_epilogues += 1
            self.task = None

    def _abort(self, task: GraphTask) -> None:
        try:
            self._aborts.emit(task)
        finally:
            self.num_aborted += 1
            self.task = None
