"""The backward lifecycle on plain autograd, in one process: tasks, nesting, aborts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from zerodp.backward.lifecycle import BackwardLifecycle


class Recorder:
    def __init__(self, lifecycle: BackwardLifecycle) -> None:
        self.events: list[tuple[str, int]] = []
        lifecycle.on_prologue(lambda task: self.events.append(("prologue", task.task_id)))
        lifecycle.on_epilogue(lambda task: self.events.append(("epilogue", task.task_id)))
        lifecycle.on_abort(lambda task: self.events.append(("abort", task.task_id)))


def _observed(lifecycle: BackwardLifecycle, tensor: torch.Tensor) -> torch.Tensor:
    tensor.register_hook(lambda grad: lifecycle.observe() and None)
    return tensor


def test_each_backward_on_a_retained_graph_is_its_own_task() -> None:
    lifecycle = BackwardLifecycle()
    recorder = Recorder(lifecycle)
    w = torch.randn(3, requires_grad=True)
    y = _observed(lifecycle, w * 2)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    kinds = [kind for kind, _ in recorder.events]
    assert kinds == ["prologue", "epilogue", "prologue", "epilogue"]
    assert recorder.events[0][1] != recorder.events[2][1]
    assert not lifecycle.running


def test_autograd_grad_is_a_task_and_hooks_repeat_within_it() -> None:
    lifecycle = BackwardLifecycle()
    recorder = Recorder(lifecycle)
    x = torch.randn(3, requires_grad=True)
    a = _observed(lifecycle, x * 2)
    b = _observed(lifecycle, x * 3)
    torch.autograd.grad((a + b).sum(), x)
    assert [kind for kind, _ in recorder.events] == ["prologue", "epilogue"]


@pytest.mark.parametrize("outer_hook", [True, False])
def test_reentrant_checkpoint_is_folded_into_the_enclosing_task(outer_hook: bool) -> None:
    """The recomputation's own backward (a nested task) belongs to the task that runs it.

    The engine hooks the root module's outputs, which receive their gradient before any
    checkpointed block inside the model: the enclosing task has started when the nested one
    begins (outer_hook=True). When the checkpoint wraps everything zerodp hooks, only the
    nested task is seen, and it is the one task (outer_hook=False).
    """
    lifecycle = BackwardLifecycle()
    recorder = Recorder(lifecycle)
    layer = torch.nn.Linear(4, 4)

    def block(h: torch.Tensor) -> torch.Tensor:
        out = layer(h)
        if out.requires_grad:
            _observed(lifecycle, out)
        return out.relu()

    x = torch.randn(2, 4, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=True)
    if outer_hook:
        _observed(lifecycle, out)
    out.sum().backward()
    assert [kind for kind, _ in recorder.events] == ["prologue", "epilogue"]
    assert lifecycle.num_prologues == lifecycle.num_epilogues == 1


def test_a_task_that_raised_is_aborted_by_the_next_entry_point() -> None:
    lifecycle = BackwardLifecycle()
    recorder = Recorder(lifecycle)
    x = torch.randn(3, requires_grad=True)
    y = _observed(lifecycle, x * 2)
    z = y * 3

    def explode(grad: torch.Tensor) -> None:
        raise RuntimeError("boom")

    y.register_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        z.sum().backward()
    assert lifecycle.running  # autograd never ran the epilogue
    assert lifecycle.abort_if_stale()
    assert [kind for kind, _ in recorder.events] == ["prologue", "abort"]
    assert not lifecycle.running


def test_a_new_task_after_a_dead_one_aborts_it_first() -> None:
    lifecycle = BackwardLifecycle()
    recorder = Recorder(lifecycle)
    x = torch.randn(3, requires_grad=True)
    y = _observed(lifecycle, x * 2)
    z = y * 3

    def explode(grad: torch.Tensor) -> None:
        raise RuntimeError("boom")

    # y's hooks run in registration order: the lifecycle observes (the task starts), then
    # the task dies inside backward, so autograd never runs its epilogue.
    y.register_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        (y.sum() + z.sum()).backward()
    assert lifecycle.running and lifecycle.num_prologues == 1 and lifecycle.num_aborted == 0
    (dead,) = [task for kind, task in recorder.events if kind == "prologue"]
    # The next task's first hook (same depth, another task) aborts the dead one, then starts.
    w = _observed(lifecycle, x * 5)
    w.sum().backward()
    assert lifecycle.num_aborted == 1
    kinds = [kind for kind, _ in recorder.events]
    assert kinds == ["prologue", "abort", "prologue", "epilogue"]
    assert kinds[-2:] == ["prologue", "epilogue"]
    new = recorder.events[2][1]
    assert recorder.events[1] == ("abort", dead)
    assert new != dead and recorder.events[3] == ("epilogue", new)
    assert lifecycle.num_epilogues == 1
    assert not lifecycle.running
