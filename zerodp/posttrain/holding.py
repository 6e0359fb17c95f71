"""Holding stage 3 groups for a while and leaving their gather state exactly as it was.

Generation, weight streaming (for LoRA deltas) and the layer-by-layer stream
gather groups outside any forward. Afterwards each group must be where it was
before: a group held by a `GatheredParameters` block stays gathered; every
other one is released. A group a forward kept gathered for its backward is
released first, as on a rank that has let it go already, so that every rank
gathers alike ([Note: kept for the backward's head] in
`zerodp.stage3.forward_graphs`); the backward gathers it again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from zerodp.group_state import GroupIndex, GroupState, ParamStatus
from zerodp.stage3.gatherer import GroupGatherer
from zerodp.stage3.runtime import ResidentParams, Stage3Runtime

ParamRuntime = ResidentParams | Stage3Runtime


def gatherer_of(runtime: ParamRuntime) -> GroupGatherer | None:
    """The stage 3 gatherer, or None at stages 0-2 (nothing is ever gathered there)."""
    return runtime.gatherer if isinstance(runtime, Stage3Runtime) else None


def sharded_groups_of(params: Iterable[torch.Tensor], index: GroupIndex) -> list[GroupState]:
    """The distinct sharded groups of `params`, in group order (the same on every rank)."""
    found: dict[int, GroupState] = {}
    for param in params:
        state = index.state_of(param)
        if state is not None and state.gather is not None:
            found.setdefault(state.order, state)
    return [found[order] for order in sorted(found)]


@contextlib.contextmanager
def held(gatherer: GroupGatherer | None, states: list[GroupState]) -> Iterator[None]:
    """Gather `states` (all in flight at once) and hold them; then restore their status.

    A collective at stage 3: every rank passes the same groups in the same order.
    """
    if gatherer is None or not states:
        yield
        return
    gatherer.release_kept(states)  # gathered again, as on a rank that let them go already
    before = {id(s) for s in states if s.sharded_gather.status is not ParamStatus.NOT_AVAILABLE}
    gatherer.hold_all(states)
    try:
        yield
    finally:
        gatherer.unhold_all(states, release=False)
        for state in states:
            if id(state) not in before:
                gatherer.release(state)
