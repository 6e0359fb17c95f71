"""Gradient reduction: each rank's local gradient, averaged over ranks, into the kept gradients.

[Note: gradient reduction]
Autograd accumulates a parameter's gradient for one graph task into a fresh
`param.grad` (zerodp keeps `param.grad` at None while a task runs); the
parameter's post-accumulate hook hands it to `contribute`, which moves it into
the group's kept gradient and drops `param.grad` again. So every graph task's
contribution is seen exactly once, whichever way backward was called.

Where a contribution goes depends on the kept gradient's `GradSync`:
- LOCAL (stages 0 and 1, between accumulation boundaries): added straight into
  the full kept gradient, which then holds this rank's unreduced sum. At a
  boundary task it is reduced in place (all-reduce at stage 0,
  reduce-scatter at stage 1) and becomes AVERAGED.
- AVERAGED (stages 2 and 3 always; stages 0 and 1 after a reduction until
  `zero_grad()`): copied into a bucket, the bucket is reduced, and the
  averaged result is added to the kept gradient. So a second backward on a
  retained graph, before or after a boundary, adds its own averaged
  contribution, and gradients add up across backward passes until
  `zero_grad()`, as in PyTorch.

Collectives are launched in one fixed group order on every rank (a group
waits for the groups before it), so ranks whose autograd fires hooks in a
different order still issue identical collective sequences. Groups that got no
contribution on this rank are still reduced (with zeros) at the task's end
when the task produced any gradient at all: every rank must run the same
backward calls over the same parameters, as with DDP. A task that produced no
gradient (`torch.autograd.grad`) reduces and finalizes nothing.

With shard groups that replicate each other (see [Note: shard groups] in
`zerodp.comm.topology`) the reductions above run in the shard group, and
averaging across the replica group follows: a stage 2-3 kept gradient starts
PARTIAL (its shard group's average) and is all-reduced across replicas in
place by the boundary task, as each group's shard-group reduction completes;
a stage 1 boundary reduce-scatter is followed by the same all-reduce; a
contribution to an AVERAGED kept gradient is all-reduced across replicas in
its bucket before it is added. So between boundaries no byte leaves the
shard group.

Groups inside a stage 3 leaf module (see [Note: leaf modules]) are held back
(`hold_back`): however early their gradients are complete on this rank, they
are launched only when `settle` says the leaf's backward is done, with zeros
for parameters that got nothing (an expert no token was routed to), so every
rank launches them at the same point between its parameter gathers.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from zerodp.backward.buffers import BufferPool
from zerodp.backward.param_grad_views import ParamGradView
from zerodp.backward.plan import FullReduce, ReductionPlan
from zerodp.backward.signals import Signal
from zerodp.comm import Comm, Handle
from zerodp.comm.order import CollectiveOrder
from zerodp.errors import LifecycleError
from zerodp.group import GradSync, GroupState, KeptGradient
from zerodp.torch_internals import PlainTensorOps


class _LaunchKind(enum.Enum):
    IN_PLACE = "in_place"  # a LOCAL kept gradient reduced where it is
    BUCKET = "bucket"  # a task's contribution reduced in its bucket, then added
    IN_PLACE_ACROSS = "in_place_across"  # a PARTIAL kept shard averaged across replicas
    BUCKET_ACROSS = "bucket_across"  # a bucket's reduced shard averaged across replicas


@dataclass
class _InFlight:
    state: GroupState
    kind: _LaunchKind
    handle: Handle
    bucket: torch.Tensor | None
    numel: int


@dataclass
class _RunningTask:
    """The reducer's view of the graph task now running."""

    is_boundary: bool
    contribution_scale: float  # multiplies contributions on their way in (fp16, see begin_task)
    rank_scale: float = 1.0  # the world size over the ranks contributing (see `rank_scale`)
    has_contributions: bool = False
    next_launch: int = 0  # groups before this index have been launched in this task
    held_back: frozenset[GroupState] = frozenset()  # launched and released at `settle` only
    unsettled: set[GroupState] = field(default_factory=set)  # held back, not yet settled


def _kept(state: GroupState) -> KeptGradient:
    grads = state.grads
    if grads is None:  # pragma: no cover - the reducer only holds trainable groups
        raise RuntimeError(f"internal error: {state} has no kept gradient")
    return grads


class GradientReducer:
    """Moves each graph task's gradients into the kept gradients, reduced as the stage says.

    Holds the trainable groups in their collective order; per-group task state
    is `KeptGradient.task`, per-task state `_RunningTask`.
    """

    def __init__(
        self,
        states: list[GroupState],
        comm: Comm,
        plan: ReductionPlan,
        *,
        comm_dtype: torch.dtype | None = None,
        max_inflight_elements: int,
        overlap_comm: bool,
        replicas: Comm | None = None,
    ) -> None:
        if plan.across_replicas != (replicas is not None):
            raise RuntimeError("internal error: a plan across replicas needs the replica group")
        self.comm = comm  # the shard group (every rank without replicas)
        self.replicas = replicas  # the replica group, with shard groups that replicate
        self.plan = plan
        # Whether a PARTIAL kept gradient goes on across replicas once its shard group's
        # reduction is in (a boundary task, or a boundary step's `reduce_local`).
        self._across_now = False
        self.overlap_comm = overlap_comm
        self.max_inflight_elements = max(1, max_inflight_elements)
        self.comm_dtype = comm_dtype
        self.states = states
        self.on_contributions_complete: Signal[GroupState] = Signal()
        self._pool = BufferPool()
        self._inflight: deque[_InFlight] = deque()
        self._inflight_elements = 0
        self._task = _RunningTask(is_boundary=False, contribution_scale=1.0)
        self._held_back: frozenset[GroupState] = frozenset()
        self.order: CollectiveOrder | None = None  # stage 3 checks its collectives' order
        # Reductions divide by the world size; when only some ranks contribute (a join
        # context averaging over the ranks still training) tasks scale by world / those.
        self.rank_scale = 1.0
        self.param_grads = ParamGradView(states) if plan.expose_param_grads else None

    @property
    def bucket_numel_held(self) -> int:
        """The most elements of full-size gradient buckets this reducer has held at once."""
        return self._pool.allocated_numel

    @property
    def bucket_numel_idle(self) -> int:
        """Elements of full-size gradient buckets held now with no reduction using them."""
        return self._pool.idle_numel

    @property
    def any_local(self) -> bool:
        """Whether some kept gradient is not yet averaged over every rank (LOCAL or PARTIAL)."""
        return any(_kept(s).sync is not GradSync.AVERAGED for s in self.states)

    # -- the graph task --------------------------------------------------------------

    def begin_task(self, is_boundary: bool, contribution_scale: float = 1.0) -> None:
        """Prologue: every parameter's `.grad` must be None so that autograd starts afresh.

        `contribution_scale` multiplies this task's gradients on their way in, so
        that every kept gradient carries the same factor whichever way backward
        was called (see `mark_task_scaled`).
        """
        self._task = _RunningTask(
            is_boundary=is_boundary,
            contribution_scale=contribution_scale,
            rank_scale=self.rank_scale,
            held_back=self._held_back,
            unsettled=set(self._held_back),
        )
        self._across_now = is_boundary
        if self.param_grads is not None:
            self.param_grads.reclaim(self.plan.initial_sync)
        for state in self.states:
            _kept(state).task.reset()
            for param in state.params:
                param.grad = None

    def mark_task_scaled(self) -> None:
        """The running task's loss already carries every factor (it came from `engine.scale`)."""
        if self._task.contribution_scale == 1.0:
            return
        if self._task.has_contributions:
            raise LifecycleError(
                "one backward mixes a loss returned by engine.scale() with a loss that was "
                "not scaled; pass every loss of one backward through engine.scale(), or none"
            )
        self._task.contribution_scale = 1.0

    def contribute(self, state: GroupState, position: int, param: nn.Parameter) -> None:
        """Post-accumulate hook: move this task's gradient of `param` into the kept gradient."""
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        kept = _kept(state)
        flat_grad = grad.detach().reshape(-1)
        scale = self._task.contribution_scale * self._task.rank_scale
        if scale != 1.0:
            flat_grad = flat_grad * scale
        self._task.has_contributions = True
        if kept.task.launched:
            self._reopen(state)
        start, end = state.flat.slot_of(position)
        if kept.sync is GradSync.LOCAL:
            kept.storage[start:end].add_(flat_grad)
        else:
            bucket = self._bucket_for(kept)
            if kept.task.bucket_written[position]:
                bucket[start:end].add_(flat_grad)
            else:
                bucket[start:end].copy_(flat_grad)
                kept.task.bucket_written[position] = True
        if kept.task.mark(position) and kept.task.complete:
            self._launch_ready()
            if state not in self._task.held_back:  # a leaf's groups go when the leaf is done
                self.on_contributions_complete.emit(state)

    def hold_back(self, states: frozenset[GroupState]) -> None:
        """From the next task on, launch these groups only once `settle` names them."""
        self._held_back = states

    def settle(self, states: list[GroupState]) -> None:
        """Every gradient these groups get in this task is in: launch them (zeros for the rest).

        Groups not held back are left to the usual rule. In a task with no contribution
        at all (`torch.autograd.grad`) nothing is reduced, as at the task's end.
        """
        task = self._task
        settled = [s for s in states if s in task.unsettled]
        if not settled:
            return
        task.unsettled.difference_update(settled)
        if not task.has_contributions:
            return
        for state in settled:
            progress = _kept(state).task
            for position in range(len(progress.contributed)):
                progress.mark(position)  # no gradient here: the bucket's zeros go in
        self._launch_ready()

    def end_task(self) -> None:
        """Epilogue: reduce what the task left unreduced, wait for every reduction.

        Every bucket is back in the pool then, and none is needed before the next
        task: they are let go rather than kept through the step and the next forward.
        """
        if self._task.has_contributions:
            for state in self.states:
                if not _kept(state).task.launched:
                    self._launch(state)
            self._drain()
        for state in self.states:
            _kept(state).task.reset()
        self._pool.release_idle()
        self._show_param_grads()

    def abort_task(self) -> None:
        """A task died part-way: wait for what was launched, drop what was collected."""
        self._across_now = False  # nothing new is issued on the way out
        self._drain()
        for state in self.states:
            kept = _kept(state)
            if kept.task.bucket is not None:
                self._pool.give_back(kept.task.bucket)
                kept.task.bucket = None
            kept.task.reset()
            for param in state.params:
                param.grad = None
        self._pool.release_idle()
        self._show_param_grads()

    # -- outside backward --------------------------------------------------------------

    def reduce_local(self) -> None:
        """Reduce groups not yet averaged over every rank (a boundary step without a boundary
        task): local sums in place, shard-group averages across replicas."""
        self._across_now = True
        for state in self.states:
            sync = _kept(state).sync
            if sync is GradSync.LOCAL:
                self._launch_in_place(state)
            elif sync is GradSync.PARTIAL:
                self._launch_across(state, _LaunchKind.IN_PLACE_ACROSS, None)
        self._drain()
        self._across_now = False
        self._show_param_grads()

    def zero(self) -> None:
        self._drain()
        for state in self.states:
            kept = _kept(state)
            kept.zero()  # its memory is free until the next reduction's result
            kept.sync = self.plan.initial_sync
            if self.param_grads is None:
                with PlainTensorOps():  # metadata only: no stage 3 dispatch per parameter
                    for param in state.params:
                        param.grad = None
        self._show_param_grads()

    def _show_param_grads(self) -> None:
        if self.param_grads is not None:
            self.param_grads.show()

    def show_param_grads(self) -> None:
        """Show the kept gradients as `param.grad` again (stage 0; after a checkpoint load)."""
        self._show_param_grads()

    def full_grad(self, state: GroupState, position: int) -> torch.Tensor:
        """The full rank-averaged gradient of one parameter (a collective: every rank calls it)."""
        kept = _kept(state)
        flat = state.flat
        start, end = flat.slot_of(position)
        shape = flat.layout.slots[position].shape
        if kept.sync is GradSync.LOCAL:
            local = kept.storage[start:end].clone()
            self.comm.all_reduce(local)
            local.div_(self.comm.world_size)
            return self._across_replicas_now(local).view(shape)
        if self.plan.reduces_whole_buffer:
            return kept.storage[start:end].clone().view(shape)
        gathered = torch.empty(
            flat.padded_numel, dtype=kept.storage.dtype, device=kept.storage.device
        )
        self.comm.all_gather(gathered, kept.shard_of_storage())
        part = gathered[start:end].clone()
        if kept.sync is GradSync.PARTIAL:
            part = self._across_replicas_now(part)
        return part.view(shape)

    def _across_replicas_now(self, shard_group_average: torch.Tensor) -> torch.Tensor:
        """The average over every rank of values already averaged over the shard group."""
        if self.replicas is not None:
            self.replicas.all_reduce(shard_group_average)
            shard_group_average.div_(self.replicas.world_size)
        return shard_group_average

    # -- launching -------------------------------------------------------------------

    def _launch_ready(self) -> None:
        """Launch, in the fixed group order, every group whose turn has come."""
        task = self._task
        while task.next_launch < len(self.states):
            state = self.states[task.next_launch]
            progress = _kept(state).task
            if progress.launched:
                task.next_launch += 1
                continue
            if not progress.complete or state in task.unsettled:
                return
            self._launch(state)
            task.next_launch += 1

    def _launch(self, state: GroupState) -> None:
        kept = _kept(state)
        kept.task.launched = True
        if kept.sync is GradSync.LOCAL:
            if self._task.is_boundary:
                self._launch_in_place(state)
            return
        bucket = self._bucket_for(kept)
        self._zero_unwritten(kept, bucket)
        kept.task.bucket = None
        self._make_room(bucket.numel())
        self._note(state)
        # Always issued asynchronously: without overlap, _track waits for it at once, and the
        # wait is zerodp's own (watched, see [Note: collective order]).
        if self.plan.reduces_whole_buffer:
            handle = self.comm.all_reduce(bucket, async_op=True)
        else:
            start, end = state.flat.shard_range
            handle = self.comm.reduce_scatter(bucket[start:end], bucket, async_op=True)
        self._track(_InFlight(state, _LaunchKind.BUCKET, handle, bucket, bucket.numel()))

    def _launch_in_place(self, state: GroupState) -> None:
        kept = _kept(state)
        self._note(state)
        if self.plan.full_reduce is FullReduce.ALL_REDUCE:
            handle = self.comm.all_reduce(kept.storage, async_op=True)
        else:
            handle = self.comm.reduce_scatter(kept.shard_of_storage(), kept.storage, async_op=True)
        numel = kept.storage.numel()
        self._track(_InFlight(state, _LaunchKind.IN_PLACE, handle, None, numel))

    def _launch_across(
        self, state: GroupState, kind: _LaunchKind, bucket: torch.Tensor | None
    ) -> None:
        """Average a shard-group average across the replica group: the kept shard in place
        (IN_PLACE_ACROSS), or a bucket's reduced shard before it is added (BUCKET_ACROSS)."""
        replicas = self.replicas
        if replicas is None:  # pragma: no cover - only launched with replicas
            raise RuntimeError("internal error: no replica group")
        if bucket is None:
            target = _kept(state).shard_of_storage()
        else:
            start, end = state.flat.shard_range
            target = bucket[start:end]
        self._note(state, "reduce across replicas")
        handle = replicas.all_reduce(target, async_op=True)
        self._track(_InFlight(state, kind, handle, bucket, target.numel()))

    def _note(self, state: GroupState, operation: str = "reduce") -> None:
        if self.order is not None:
            self.order.note(operation, state.order)

    def _track(self, inflight: _InFlight) -> None:
        self._inflight.append(inflight)
        self._inflight_elements += inflight.numel
        if not self.overlap_comm:
            self._finalize_oldest()

    def _make_room(self, numel: int) -> None:
        while self._inflight and self._inflight_elements + numel > self.max_inflight_elements:
            self._finalize_oldest()

    def _drain(self) -> None:
        while self._inflight:
            self._finalize_oldest()

    def _finalize_oldest(self) -> None:
        inflight = self._inflight.popleft()
        self._inflight_elements -= inflight.numel
        inflight.handle.wait()
        state, kind = inflight.state, inflight.kind
        kept = _kept(state)
        world_size = self.comm.world_size
        if kind is _LaunchKind.IN_PLACE:
            if self.plan.full_reduce is FullReduce.ALL_REDUCE:
                kept.storage.div_(world_size)
                kept.sync = GradSync.AVERAGED
                return
            kept.shard_of_storage().div_(world_size)
            kept.sync = GradSync.AVERAGED if self.replicas is None else GradSync.PARTIAL
            self._go_across_if_due(state)
            return
        if kind is _LaunchKind.IN_PLACE_ACROSS:
            kept.shard_of_storage().div_(self._num_replicas)
            kept.sync = GradSync.AVERAGED
            return
        bucket = inflight.bucket
        if bucket is None:  # pragma: no cover - a bucket launch always carries its bucket
            raise RuntimeError("internal error: bucket reduction without a bucket")
        if self.plan.reduces_whole_buffer:
            kept.storage.add_(bucket.div_(world_size))
            self._pool.give_back(bucket)
            return
        start, end = state.flat.shard_range
        if kind is _LaunchKind.BUCKET_ACROSS:
            kept.shard_of_storage().add_(bucket[start:end].div_(self._num_replicas))
            self._pool.give_back(bucket)
            return
        part = bucket[start:end].div_(world_size)
        if kept.sync is GradSync.AVERAGED and self.replicas is not None:
            self._launch_across(state, _LaunchKind.BUCKET_ACROSS, bucket)  # added once across
            return
        kept.shard_of_storage().add_(part)
        self._pool.give_back(bucket)
        self._go_across_if_due(state)

    @property
    def _num_replicas(self) -> int:
        return 1 if self.replicas is None else self.replicas.world_size

    def _go_across_if_due(self, state: GroupState) -> None:
        """At a boundary, a PARTIAL kept gradient whose shard-group reduction is in goes on
        across the replicas (see [Note: gradient reduction])."""
        if self._across_now and _kept(state).sync is GradSync.PARTIAL:
            self._launch_across(state, _LaunchKind.IN_PLACE_ACROSS, None)

    def _reopen(self, state: GroupState) -> None:
        """A contribution after the group was launched in this task (a nested task's).

        Everything launched up to the group's last reduction in flight is finished, in
        order (a reduction across replicas follows its shard group's, so it may be
        launched while finishing): the group has nothing in flight when it reopens.
        """
        while any(inflight.state is state for inflight in self._inflight):
            self._finalize_oldest()
        _kept(state).task.launched = False

    def _bucket_for(self, kept: KeptGradient) -> torch.Tensor:
        task = kept.task
        if task.bucket is None:
            dtype = self.comm_dtype or kept.flat.dtype
            task.bucket = self._pool.take(kept.flat.padded_numel, dtype, kept.flat.device)
            task.bucket_written = [False] * len(kept.flat.params)
        return task.bucket

    @staticmethod
    def _zero_unwritten(kept: KeptGradient, bucket: torch.Tensor) -> None:
        for position, written in enumerate(kept.task.bucket_written):
            if not written:
                start, end = kept.flat.slot_of(position)
                bucket[start:end].zero_()
        bucket[kept.flat.numel :].zero_()
