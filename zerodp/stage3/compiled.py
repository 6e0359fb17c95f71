"""Stage 3 under `torch.compile`: which hooks a traced graph keeps, and what it may read.

[Note: stage 3 under torch.compile]
Gathering and releasing are collectives and allocation changes that a graph
cannot contain, so they stay outside compiled graphs, at unit boundaries:

- a compiled block is a leaf module (see [Note: leaf modules]): its whole
  subtree is gathered when it is entered. The hooks of a module that gathers
  (a leaf, a module with groups, the root), when dynamo meets them in a
  traced forward, are `torch._dynamo.disable`d: the graph breaks at that
  boundary and the hooks run eagerly;
- inside a running leaf the module hooks do nothing (their compile branch is
  traceable: it reads only the leaf count), so a block is one graph;
- gathered parameters have the plain class (`GatherState.guard_with`), so a
  traced graph reads them as it reads any parameter; a parameter that is
  still a `ZeroParameter` when dynamo traces an operation on it is not
  gathered: the operation runs eagerly, gathering on use (a graph break),
  never on a released parameter. The graph dynamo compiled guards on the
  parameter's class, so a later call that finds it released recompiles
  instead of reading freed storage.

`UnitDepth.leaves` counts the leaves running now; dynamo guards on it, and
it is the same at every step, so it costs no recompile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class UnitDepth:
    """How many leaves (gathered as one unit) are running their forward now."""

    leaves = 0


def run_eagerly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, run outside any graph when dynamo meets it (a graph break at that point)."""
    return torch._dynamo.disable(fn, reason="zerodp stage 3 gathers and releases here")
