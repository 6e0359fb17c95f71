"""The private autograd APIs zerodp depends on, wrapped in one place.

Everything else in zerodp calls these functions, so a change in PyTorch's
internals is a change to this file only. See [Note: backward lifecycle] in
`zerodp.backward.lifecycle` for how they are used.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch.autograd import Variable

_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)  # torch >= 2.3
_RUN_BACKWARD_CODE = getattr(_run_backward, "__code__", None)

NO_TASK = -1


def current_graph_task_id() -> int:
    """The id of the autograd graph task running on this thread, or -1 outside backward."""
    return int(torch._C._current_graph_task_id())


def in_backward() -> bool:
    return current_graph_task_id() != NO_TASK


def queue_task_callback(callback: Callable[[], None]) -> None:
    """Run `callback` once the current graph task has finished all of its nodes.

    Only valid while a graph task is running (from inside a hook). Autograd
    does not run the callback when the task ends in an exception.
    """
    Variable._execution_engine.queue_callback(callback)


def engine_depth() -> int:
    """How many calls into the autograd engine enclose this point on this thread's stack.

    A graph task started from inside another task's node (reentrant activation
    checkpointing calls `torch.autograd.backward` from its backward) runs one
    level deeper than the task that encloses it.
    """
    depth = 0
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if _RUN_BACKWARD_CODE is not None:
            if code is _RUN_BACKWARD_CODE:
                depth += 1
        elif code.co_name in ("backward", "grad") and "autograd" in code.co_filename:
            depth += 1
        frame = frame.f_back  # type: ignore[assignment]
    return depth


def increment_version(tensors: Iterable[torch.Tensor]) -> None:
    """Mark tensors as modified in place, as an optimizer step on them would.

    A graph retained across `step()` then fails its next backward with
    PyTorch's usual "modified by an inplace operation" error instead of
    silently using the new weights.
    """
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is None:  # pragma: no cover - torch < 2.1
        return
    for tensor in tensors:
        bump(tensor)


def saved_tensor_hooks_active() -> bool:
    """Whether some saved-tensor hooks (e.g. non-reentrant checkpointing's) are active now."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - very old releases
        return False
    return top(False) is not None


_FREED_KEY = "zerodp.graph_freed"  # the key of zerodp's sentinels in a node's metadata


class _GraphSentinel:
    """Stored in the metadata of graph nodes: it lives exactly as long as the last of them."""


def on_graph_freed(
    nodes: Iterable[torch.autograd.graph.Node], callback: Callable[[], None]
) -> None:
    """Run `callback` once every node in `nodes` is freed (the graph they head was dropped).

    Autograd nodes cannot be weak-referenced, but each owns a `metadata` dict that
    lives and dies with it: one object stored in each node's dict dies with the last of
    them, and a finalizer on it runs then, where that happens: at once, by reference
    counting, where the last reference to the graph is dropped (`del out`, or the loss
    built from it), or inside a garbage collection when the graph was part of a
    reference cycle, in whichever thread that runs. The callback is never run at exit.
    """
    sentinel = _GraphSentinel()
    for node in nodes:
        # A property on every node class, typed as a method by torch's stubs.
        metadata = cast(dict[str, list[_GraphSentinel]], node.metadata)
        metadata.setdefault(_FREED_KEY, []).append(sentinel)
    finalizer = weakref.finalize(sentinel, callback)
    finalizer.atexit = False
