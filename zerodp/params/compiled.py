"""Stage 3 under `torch.compile`: which hooks a traced graph keeps, and what it may read.

[Note: stage 3 under torch.compile]
Gathering and releasing are collectives and allocation changes that a graph
cannot contain, so they stay outside compiled graphs, at unit boundaries:

- a unit is a leaf module (see [Note: leaf modules]; a compiled transformer
  block is made one) or a module whose own groups are its whole subtree's (a
  torch.nn layer outside every block, or a stage 3 unit of
  `stage3_unit_numel`). Its hooks, when dynamo meets them in a
  traced forward, are `torch._dynamo.disable`d: the graph breaks at the
  unit's boundary and the hooks run eagerly, so the unit's forward is a graph
  of its own with every parameter in it gathered;
- inside a running leaf the module hooks do nothing (their compile branch is
  traceable: it reads only the leaf count), so a block is one graph;
- a `ZeroParameter` read by a traced graph inside a unit is read as it is
  (gathered); read outside every unit (a parent reading a child's weight
  under whole-model compile) it breaks the graph and is gathered on use, as
  in eager mode. Never silently read while released.

`UnitDepth` counts the units (and leaves) running now; dynamo guards on the
counts, which are the same at every step, so they cost no recompile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class UnitDepth:
    """How many gathered units (leaves, or modules owning their whole subtree's groups) run."""

    value = 0
    leaves = 0  # how many of them are leaves


def run_eagerly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, run outside any graph when dynamo meets it (a graph break at that point)."""
    return torch._dynamo.disable(fn, reason="zerodp stage 3 gathers and releases here")
