"""The autograd graphs of one engine's forwards that a backward may still run through.

[Note: kept for the backward's head]
The groups a forward ends with (an output layer, an embedding tied to it) are
the ones its backward starts with. When a backward can follow, those within
the backward's first `stage3_prefetch_bucket_size` elements stay gathered at
the forward's end (`ParamCoordinator.end_forward` marks them
`kept_for_backward`) instead of being released and gathered straight back.
A backward can follow only through the forward's output, so they are kept
only while that is possible:

- An output with no graph (no tensor in it requires grad through a grad_fn:
  a frozen model, `torch.no_grad()`) keeps nothing: everything the forward
  gathered is released at its end.
- Otherwise the output's graph is watched (`ForwardGraphs.add`): when it is
  freed before any backward started on it (`del out`, or the loss built from
  it dropped), and no other forward's graph awaits a backward, the kept groups
  are released there and then.
- A backward that starts takes them over (its end releases them); the next
  forward, `step()` and `zero_grad()` release them too.

Releasing is local (never a collective), and it changes what this rank would
gather next. That stays the same on every rank because:

- a rank lets them go only when no graph of its engine's forwards awaits a
  backward: every rank runs the same backward passes, so none can run one
  through this engine before its next forward, which releases everything on
  every rank anyway (ranks drop a forward's output at the same point of the
  program, as they run the same forwards);
- what gathers outside a forward or backward (`GatheredParameters`,
  generation, weight streaming) first releases the kept groups, on every rank
  (`GroupGatherer.release_kept`), so every rank gathers the same ones.

The release runs where the graph is freed, and only touches groups still
marked: a later forward or a backward has cleared the mark, and a group held
(`GatheredParameters`) or claimed by a running forward scope is not released
(`GroupGatherer.release`). Where the graph is freed inside a garbage
collection (a reference cycle; it may run in the middle of zerodp's own
code) or in another thread than the forward's, nothing is released then: the
kept groups wait for the next forward, step or backward's end.
"""

from __future__ import annotations

import functools
import gc
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from zerodp.backward import autograd_api


class _Collections:
    """Whether a garbage collection is running now (told by `gc.callbacks`)."""

    running = False

    @staticmethod
    def observe(phase: str, info: dict[str, Any]) -> None:
        _Collections.running = phase == "start"


def _watch_collections() -> None:
    if _Collections.observe not in gc.callbacks:
        gc.callbacks.append(_Collections.observe)


class ForwardGraphs:
    """The graphs of one engine's forwards that no backward has started on yet.

    `on_all_freed` runs when the last of them is freed, unless that happens inside a
    garbage collection or in another thread (see [Note: kept for the backward's head]).
    """

    def __init__(self, on_all_freed: Callable[[], None]) -> None:
        self._on_all_freed: Callable[[], None] | None = on_all_freed
        self._waiting: set[int] = set()  # the numbers of the forwards whose graphs are alive
        self._numbers = itertools.count()
        self._thread = threading.get_ident()  # the thread that ran the last forward
        _watch_collections()

    @property
    def any_waiting(self) -> bool:
        return bool(self._waiting)

    def add(self, nodes: list[torch.autograd.graph.Node]) -> None:
        """A forward ended with an output whose graph starts at `nodes`."""
        number = next(self._numbers)
        self._waiting.add(number)
        self._thread = threading.get_ident()
        autograd_api.on_graph_freed(nodes, functools.partial(_freed, weakref.ref(self), number))

    def backward_started(self) -> None:
        """A backward started: what the forwards so far kept is its own now (its end releases
        it), and their graphs no longer count as awaiting one."""
        self._waiting.clear()

    def close(self) -> None:
        """The engine is torn down: a graph freed from now on does nothing."""
        self._on_all_freed = None
        self._waiting.clear()

    def graph_freed(self, number: int) -> None:
        """Forward `number`'s graph was freed (called by its finalizer, wherever that runs)."""
        self._waiting.discard(number)
        callback = self._on_all_freed
        if callback is None or self._waiting:
            return
        if _Collections.running or threading.get_ident() != self._thread:
            return  # not here: the next forward, step or backward's end releases them
        callback()


def _freed(graphs: weakref.ref[ForwardGraphs], number: int) -> None:
    """A forward's graph was freed (holds its `ForwardGraphs` weakly: it may be gone)."""
    watched = graphs()
    if watched is not None:
        watched.graph_freed(number)


def graph_nodes(tensors: list[torch.Tensor]) -> list[torch.autograd.graph.Node]:
    """The graph nodes that produced `tensors` (those made by autograd-recorded operations)."""
    return [t.grad_fn for t in tensors if t.grad_fn is not None]
