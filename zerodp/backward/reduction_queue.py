"""Gradient reductions in flight: how each is launched, and what happens when it completes.

The reducer (see [Note: gradient reduction] in `zerodp.backward.reducer`) decides
*what* to reduce and *when*; this queue owns *how*: the collective each kind of
launch issues, in which group, what its result is divided by (asked of the
parallel dims, never computed here: see [Note: parallel dimensions] in
`zerodp.parallel.dims`), and the bounded queue of reductions in flight,
finished oldest first. A reduction in a different form (compressed, quantized)
would be one more launch kind here; the reducer would not change.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

import torch

from zerodp.backward.buffers import BufferPool
from zerodp.backward.reduction_plan import FullReduce, ReductionPlan
from zerodp.comm import Comm, Handle
from zerodp.comm.faults.collective_order import CollectiveOrder
from zerodp.group_state import GradSync, GroupState, KeptGradient
from zerodp.parallel import EXPERT_DATA, REPLICA, SHARD, ParallelDims
from zerodp.partition import Slicing


class LaunchKind(enum.Enum):
    IN_PLACE = "in_place"  # a LOCAL kept gradient reduced where it is
    BUCKET = "bucket"  # a task's contribution reduced in its bucket, then added
    IN_PLACE_ACROSS = "in_place_across"  # a PARTIAL kept shard averaged across replicas
    BUCKET_ACROSS = "bucket_across"  # a bucket's reduced shard averaged across replicas


@dataclass
class _InFlight:
    state: GroupState
    kind: LaunchKind
    handle: Handle
    bucket: torch.Tensor | None
    numel: int


def kept_gradient(state: GroupState) -> KeptGradient:
    grads = state.grads
    if grads is None:  # pragma: no cover - the reducer only holds trainable groups
        raise RuntimeError(f"internal error: {state} has no kept gradient")
    return grads


class ReductionQueue:
    """Launches reductions in each group's shard group (and across replicas), finishes them in
    order.

    Each group is reduced over `state.comm` (the shard group; for expert slices the
    expert-data group) and divided by what the dims say for that kind of group; `comm` is
    the shard group (for values not of one group), `replicas` the replica group (None
    without replicas).
    At most `max_inflight_elements` elements are in flight (the oldest is finished
    first to make room); without `overlap_comm` each reduction is waited for at once.
    """

    def __init__(
        self,
        comm: Comm,
        plan: ReductionPlan,
        dims: ParallelDims,
        pool: BufferPool,
        *,
        max_inflight_elements: int,
        overlap_comm: bool,
        replicas: Comm | None = None,
        order: CollectiveOrder | None = None,
    ) -> None:
        if plan.across_replicas != (replicas is not None):
            raise RuntimeError("internal error: a plan across replicas needs the replica group")
        self.comm = comm
        self.replicas = replicas
        self.plan = plan
        self.order = order  # stage 3 checks its collectives' order
        self._pool = pool
        self._divisors = {
            Slicing.WHOLE: dims.gradient_divisor(SHARD),
            Slicing.TENSOR: dims.gradient_divisor(SHARD),
            Slicing.EXPERT: dims.gradient_divisor(EXPERT_DATA),
        }
        self._replica_divisor = dims.gradient_divisor(REPLICA)
        self.overlap_comm = overlap_comm
        self.max_inflight_elements = max(1, max_inflight_elements)
        self._inflight: deque[_InFlight] = deque()
        self._inflight_elements = 0
        # Whether a PARTIAL kept gradient goes on across replicas once its shard group's
        # reduction is in (a boundary task, or a boundary step's `reduce_local`).
        self.across_now = False

    # -- launching -----------------------------------------------------------------------

    def launch_bucket(self, state: GroupState, bucket: torch.Tensor) -> None:
        """Reduce a task's contribution in its bucket; the result is added when it is in."""
        self._make_room(bucket.numel())
        self._note(state)
        # Always issued asynchronously: without overlap, _track waits for it at once, and the
        # wait is zerodp's own (watched, see [Note: collective order]).
        if self.plan.reduces_whole_buffer:
            handle = state.comm.all_reduce(bucket, async_op=True)
        else:
            start, end = state.flat.shard_range
            handle = state.comm.reduce_scatter(bucket[start:end], bucket, async_op=True)
        self._track(_InFlight(state, LaunchKind.BUCKET, handle, bucket, bucket.numel()))

    def launch_in_place(self, state: GroupState) -> None:
        """Reduce a LOCAL kept gradient where it is (all-reduce or reduce-scatter)."""
        kept = kept_gradient(state)
        self._note(state)
        if self.plan.full_reduce is FullReduce.ALL_REDUCE:
            handle = state.comm.all_reduce(kept.storage, async_op=True)
        else:
            handle = state.comm.reduce_scatter(kept.shard_of_storage(), kept.storage, async_op=True)
        numel = kept.storage.numel()
        self._track(_InFlight(state, LaunchKind.IN_PLACE, handle, None, numel))

    def launch_across(
        self, state: GroupState, kind: LaunchKind, bucket: torch.Tensor | None
    ) -> None:
        """Average a shard-group average across the replica group: the kept shard in place
        (IN_PLACE_ACROSS), or a bucket's reduced shard before it is added (BUCKET_ACROSS)."""
        replicas = self.replicas
        if replicas is None:  # pragma: no cover - only launched with replicas
            raise RuntimeError("internal error: no replica group")
        if bucket is None:
            target = kept_gradient(state).shard_of_storage()
        else:
            start, end = state.flat.shard_range
            target = bucket[start:end]
        self._note(state, "reduce across replicas")
        handle = replicas.all_reduce(target, async_op=True)
        self._track(_InFlight(state, kind, handle, bucket, target.numel()))

    # -- reductions done now, outside the queue --------------------------------------------

    def average_now(self, state: GroupState, local_sum: torch.Tensor) -> torch.Tensor:
        """The average over every data rank of a tensor of `state` holding this rank's local
        sum."""
        state.comm.all_reduce(local_sum)
        local_sum.div_(self.divisor_of(state))
        return self.across_replicas_now(local_sum)

    def divisor_of(self, state: GroupState) -> int:
        """What a sum over `state`'s shard group is divided by (asked of the dims at build)."""
        return self._divisors[state.flat.slicing]

    def across_replicas_now(self, shard_group_average: torch.Tensor) -> torch.Tensor:
        """The average over every data rank of values already averaged over the shard group."""
        if self.replicas is not None:
            self.replicas.all_reduce(shard_group_average)
            shard_group_average.div_(self._replica_divisor)
        return shard_group_average

    # -- finishing -----------------------------------------------------------------------

    def drain(self) -> None:
        while self._inflight:
            self._finalize_oldest()

    def finish_through(self, state: GroupState) -> None:
        """Finish, in order, everything up to `state`'s last reduction in flight.

        A reduction across replicas follows its shard group's, so it may be launched
        while finishing: `state` has nothing in flight afterwards.
        """
        while any(inflight.state is state for inflight in self._inflight):
            self._finalize_oldest()

    def _note(self, state: GroupState, operation: str = "reduce") -> None:
        """The collective order check's note: in the shard group, or across replicas."""
        if self.order is not None:
            replicas = self.replicas if operation == "reduce across replicas" else None
            label = (replicas or self.comm).label
            self.order.note(operation, state.order, label)

    def _track(self, inflight: _InFlight) -> None:
        self._inflight.append(inflight)
        self._inflight_elements += inflight.numel
        if not self.overlap_comm:
            self._finalize_oldest()

    def _make_room(self, numel: int) -> None:
        while self._inflight and self._inflight_elements + numel > self.max_inflight_elements:
            self._finalize_oldest()

    def _finalize_oldest(self) -> None:
        inflight = self._inflight.popleft()
        self._inflight_elements -= inflight.numel
        inflight.handle.wait()
        state, kind = inflight.state, inflight.kind
        kept = kept_gradient(state)
        if kind is LaunchKind.IN_PLACE:
            if self.plan.full_reduce is FullReduce.ALL_REDUCE:
                kept.storage.div_(self.divisor_of(state))
                kept.sync = GradSync.AVERAGED
                return
            kept.shard_of_storage().div_(self.divisor_of(state))
            kept.sync = GradSync.AVERAGED if self.replicas is None else GradSync.PARTIAL
            self._go_across_if_due(state)
            return
        if kind is LaunchKind.IN_PLACE_ACROSS:
            kept.shard_of_storage().div_(self._replica_divisor)
            kept.sync = GradSync.AVERAGED
            return
        bucket = inflight.bucket
        if bucket is None:  # pragma: no cover - a bucket launch always carries its bucket
            raise RuntimeError("internal error: bucket reduction without a bucket")
        if self.plan.reduces_whole_buffer:
            kept.storage.add_(bucket.div_(self.divisor_of(state)))
            self._pool.give_back(bucket)
            return
        start, end = state.flat.shard_range
        if kind is LaunchKind.BUCKET_ACROSS:
            kept.shard_of_storage().add_(bucket[start:end].div_(self._replica_divisor))
            self._pool.give_back(bucket)
            return
        part = bucket[start:end].div_(self.divisor_of(state))
        if kept.sync is GradSync.AVERAGED and self.replicas is not None:
            self.launch_across(state, LaunchKind.BUCKET_ACROSS, bucket)  # added once across
            return
        kept.shard_of_storage().add_(part)
        self._pool.give_back(bucket)
        self._go_across_if_due(state)

    def _go_across_if_due(self, state: GroupState) -> None:
        """At a boundary, a PARTIAL kept gradient whose shard-group reduction is in goes on
        across the replicas (see [Note: gradient reduction])."""
        if self.across_now and kept_gradient(state).sync is GradSync.PARTIAL:
            self.launch_across(state, LaunchKind.IN_PLACE_ACROSS, None)
