"""One prologue and one epilogue per autograd graph task.

[Note: backward lifecycle]
A "backward" is one autograd graph task: one `loss.backward()`,
`engine.backward(loss)`, `engine.scale(loss).backward()` or
`torch.autograd.grad(...)`. One forward may be followed by several graph tasks
(`retain_graph=True`), and one task may span several forwards. zerodp never
assumes which call started a backward: every hook autograd fires on zerodp's
behalf (on forward outputs, module inputs, parameters' gradients, forward
hooks re-run by activation checkpointing) calls `observe()` first.

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

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from zerodp.backward import autograd_api


class TaskPhase(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"


@dataclass(frozen=True)
class GraphTask:
    """What zerodp knows of one backward graph task."""

    task_id: int
    sequence: int  # 0 for the first task this engine saw, then 1, 2, ...
    create_graph: bool  # grad mode inside the task: True for create_graph=True
    depth: int


TaskCallback = Callable[[GraphTask], None]


class _CallbackList:
    def __init__(self) -> None:
        # RemovableHandle keeps a weak reference to this dict: OrderedDict allows one.
        self._callbacks: OrderedDict[int, TaskCallback] = OrderedDict()

    def add(self, callback: TaskCallback) -> RemovableHandle:
        handle = RemovableHandle(self._callbacks)
        self._callbacks[handle.id] = callback
        return handle

    def __call__(self, task: GraphTask) -> None:
        """Run every callback, even when one raises; then re-raise the first error."""
        first_error: BaseException | None = None
        for callback in list(self._callbacks.values()):
            try:
                callback(task)
            except BaseException as error:
                if first_error is None:
                    first_error = error
        if first_error is not None:
            raise first_error


class BackwardLifecycle:
    """Tracks graph tasks and runs the registered prologues, epilogues and aborts."""

    def __init__(self) -> None:
        self.phase = TaskPhase.IDLE
        self.task: GraphTask | None = None
        self.num_prologues = 0
        self.num_epilogues = 0
        self.num_aborted = 0
        self._prologues = _CallbackList()
        self._epilogues = _CallbackList()
        self._aborts = _CallbackList()
        self._user_prologues = _CallbackList()
        self._user_epilogues = _CallbackList()

    # -- registration --------------------------------------------------------------

    def on_prologue(self, callback: TaskCallback) -> RemovableHandle:
        return self._prologues.add(callback)

    def on_epilogue(self, callback: TaskCallback) -> RemovableHandle:
        return self._epilogues.add(callback)

    def on_abort(self, callback: TaskCallback) -> RemovableHandle:
        return self._aborts.add(callback)

    def register_user_hooks(
        self, prologue: TaskCallback | None, epilogue: TaskCallback | None
    ) -> list[RemovableHandle]:
        """User hooks: the prologue runs after zerodp's, the epilogue after zerodp's."""
        handles = []
        if prologue is not None:
            handles.append(self._user_prologues.add(prologue))
        if epilogue is not None:
            handles.append(self._user_epilogues.add(epilogue))
        return handles

    # -- the hooks' entry point ------------------------------------------------------

    def observe(self) -> GraphTask | None:
        """Called first by every zerodp hook; returns the task it belongs to (None outside)."""
        task_id = autograd_api.current_graph_task_id()
        if task_id == autograd_api.NO_TASK:
            return None
        task = self.task
        if self.phase is TaskPhase.RUNNING and task is not None:
            if task_id == task.task_id:
                return task
            if autograd_api.engine_depth() > task.depth:
                return task  # a nested (reentrant) task is part of the enclosing one
            self._abort(task)  # the running task died: its epilogue will never come
        return self._start(task_id)

    def abort_if_stale(self) -> bool:
        """From an entry point outside backward: abort a task that ended in an exception."""
        task = self.task
        if (
            self.phase is TaskPhase.RUNNING
            and task is not None
            and autograd_api.current_graph_task_id() == autograd_api.NO_TASK
        ):
            self._abort(task)
            return True
        return False

    @property
    def running(self) -> bool:
        return self.phase is TaskPhase.RUNNING

    # -- transitions ---------------------------------------------------------------

    def _start(self, task_id: int) -> GraphTask:
        task = GraphTask(
            task_id=task_id,
            sequence=self.num_prologues,
            create_graph=torch.is_grad_enabled(),
            depth=autograd_api.engine_depth(),
        )
        self.task = task
        self.phase = TaskPhase.RUNNING
        self.num_prologues += 1
        autograd_api.queue_task_callback(self._finish)
        self._prologues(task)
        self._user_prologues(task)
        return task

    def _finish(self) -> None:
        task = self.task
        if task is None:  # pragma: no cover - aborted from another thread meanwhile
            return
        try:
            self._epilogues(task)
            self._user_epilogues(task)
        finally:
            self.num_epilogues += 1
            self.task = None
            self.phase = TaskPhase.IDLE

    def _abort(self, task: GraphTask) -> None:
        try:
            self._aborts(task)
        finally:
            self.num_aborted += 1
            self.task = None
            self.phase = TaskPhase.IDLE
