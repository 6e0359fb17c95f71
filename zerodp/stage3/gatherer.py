"""The gathers of one engine's sharded groups: issued, waited for, released, held, counted.

Every change to a group's allocation goes through `GroupGatherer`: a gather is
issued by `_issue` (which notes its place in the collective order first and
counts it in) and a group is released by `release` (which counts it out), so
`live_numel`, the elements gathered now, is exact, and `peak_live_numel` is its
maximum since `reset_peak()`. Only groups nobody holds are released.

When to gather and release is decided by the `ParamCoordinator`; this object
only carries it out, prefetching from a recorded order (`prefetch_window`) as
far as `stage3_prefetch_bucket_size` and `stage3_max_live_parameters` allow.
Holds (`GatheredParameters`, generation, weight streaming) come here directly;
they first release the groups a forward kept for its backward, so that every
rank gathers the same groups ([Note: kept for the backward's head] in
`zerodp.stage3.forward_graphs`).
"""

from __future__ import annotations

from zerodp.comm.faults.collective_order import CollectiveOrder
from zerodp.group_state import GatherState, GroupState, ParamStatus
from zerodp.stage3.prefetch import ExecutionTrace
from zerodp.torch_internals import storage_key


class GroupGatherer:
    """Gathers and releases the sharded groups of one engine, and counts what is gathered."""

    def __init__(
        self,
        states: list[GroupState],
        *,
        order: CollectiveOrder | None,
        prefetch_numel: int,
        max_live_numel: int,
    ) -> None:
        self.states = states
        self.order = order  # checks every gather's place in the collective order, if set
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self._by_storage = {storage_key(s.flat.full): s for s in states}
        self.live_numel = 0
        self.peak_live_numel = 0
        self.num_prefetched = 0  # groups gathered ahead of their use

    # -- queries -------------------------------------------------------------------

    def state_of_storage(self, key: int) -> GroupState | None:
        """The sharded group whose full buffer has this storage (see `storage_key`)."""
        return self._by_storage.get(key)

    @property
    def over_live_cap(self) -> bool:
        """Whether more is gathered now than `stage3_max_live_parameters` allows."""
        return self.live_numel > self.max_live_numel

    def reset_peak(self) -> None:
        self.peak_live_numel = self.live_numel

    # -- gathering -----------------------------------------------------------------

    def gather(self, state: GroupState, trace: ExecutionTrace[GroupState] | None = None) -> None:
        """Make `state` available; a request in `trace`'s pass also prefetches what follows."""
        gather = state.sharded_gather
        if gather.status is ParamStatus.NOT_AVAILABLE:
            self._issue(state, gather)
        if trace is not None and trace.request(state):
            self._prefetch_window(trace)
        gather.to_available()

    def ensure_available(self, state: GroupState) -> None:
        """Gather `state` unless it is available (autograd unpacks a tensor sharing it)."""
        if state.sharded_gather.status is not ParamStatus.AVAILABLE:
            self.gather(state)

    def gather_all(self) -> None:
        """Gather every group (the engine is being torn down, parameters become whole)."""
        for state in self.states:
            self.gather(state)

    def prefetch(self, state: GroupState) -> None:
        """Start gathering `state` without waiting for it (`hold_all` waits)."""
        gather = state.sharded_gather
        if gather.status is ParamStatus.NOT_AVAILABLE:
            self._issue(state, gather)
            self.num_prefetched += 1

    def _prefetch_window(self, trace: ExecutionTrace[GroupState]) -> None:
        """Gather the groups due within the next `stage3_prefetch_bucket_size` elements.

        The window counts every upcoming use, gathered already or not: counting
        only the groups still to gather would reach one window further at every
        request, and the gathered set would grow through the whole pass. Only the
        part of the window beyond what an earlier request of this pass looked at
        (`trace.frontier`) is new: a group before it was issued then, or was
        gathered already (one released since is gathered on use).
        """
        end = trace.window_end(self.prefetch_numel)
        index = max(trace.position, trace.frontier)
        while index < end:
            state = trace.item(index)
            gather = state.sharded_gather
            if gather.status is ParamStatus.NOT_AVAILABLE:
                if self.live_numel + gather.numel > self.max_live_numel:
                    break  # over the live cap: the next request looks here again
                self._issue(state, gather)
                self.num_prefetched += 1
            index += 1
        trace.frontier = index

    def _issue(self, state: GroupState, gather: GatherState) -> None:
        """Start gathering `state` (its place in the collective order checked first)."""
        if self.order is not None:
            # hpZ: which group the gather runs in is part of its place in the order.
            operation = "gather secondary" if gather.gathers_from_secondary else "gather"
            self.order.note(operation, state.order, gather.next_gather_label)
        self.live_numel += gather.numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        gather.to_inflight()

    # -- releasing -----------------------------------------------------------------

    def release(self, state: GroupState) -> None:
        """Release `state` unless someone holds it (a gather in flight is finished first)."""
        gather = state.sharded_gather
        if gather.releasable:
            # `param.data = t` while gathered would leave the parameter holding `t` after
            # the release, and every later gather would fill a buffer it no longer views.
            state.flat.drop_replaced()
        if gather.release_if_unused():
            self.live_numel -= gather.numel

    def release_unheld(self) -> None:
        """Release every group nobody holds (before an optimizer step, for instance); what
        a forward kept for its backward is let go, held or not."""
        for state in self.states:
            self.release(state)
        self.forget_kept()

    # -- kept for a backward ([Note: kept for the backward's head]) -----------------------

    def keep_for_backward(self, state: GroupState) -> None:
        """Leave `state` gathered after the forward that ends now, for its backward."""
        state.sharded_gather.keep_for_backward()

    def forget_kept(self) -> None:
        """The groups kept for a backward stay as they are, no longer marked (a backward
        that starts takes them over: its end releases them)."""
        for state in self.states:
            state.sharded_gather.kept_for_backward = False

    def release_kept(self, states: list[GroupState] | None = None) -> None:
        """Release the groups (of `states`, or all) kept for a backward, unless held.

        Local: no collective. Afterwards each of those groups is released, or held as
        before, on every rank alike, whether or not another rank let it go already.
        """
        for state in self.states if states is None else states:
            gather = state.sharded_gather
            if gather.kept_for_backward:
                gather.kept_for_backward = False
                self.release(state)

    # -- holds ---------------------------------------------------------------------

    def hold(self, state: GroupState) -> None:
        """Gather `state` and hold it (what a forward kept for its backward is gathered
        again, as on a rank that let it go already)."""
        self.release_kept([state])
        self.gather(state)
        state.sharded_gather.hold()

    def unhold(self, state: GroupState) -> None:
        state.sharded_gather.unhold()
        self.release(state)

    def hold_all(self, states: list[GroupState]) -> None:
        """Gather `states` with every gather in flight at once, then hold each.

        Callers pass groups in the same order on every rank (group order), as they
        would for `hold`; `unhold_all` undoes it.
        """
        self.release_kept(states)
        for state in states:
            gather = state.sharded_gather
            if gather.status is ParamStatus.NOT_AVAILABLE:
                self._issue(state, gather)
        for state in states:
            state.sharded_gather.to_available()
            state.sharded_gather.hold()

    def unhold_all(self, states: list[GroupState], release: bool = True) -> None:
        """Drop one hold of each group; with `release`, release those nobody holds now."""
        for state in states:
            state.sharded_gather.unhold()
            if release:
                self.release(state)

    def drop_holds(self) -> None:
        """Forget every hold and claim (a forward or backward died part-way)."""
        for state in self.states:
            state.sharded_gather.drop_holds()
