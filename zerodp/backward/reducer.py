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

from dataclasses import dataclass, field

import torch
from torch import nn

from zerodp.backward.accumulation import AccumulationWindow
from zerodp.backward.buffers import BufferPool
from zerodp.backward.param_grad_views import ParamGradView
from zerodp.backward.reduction_plan import ReductionPlan
from zerodp.backward.reduction_queue import LaunchKind, ReductionQueue, kept_gradient
from zerodp.backward.signals import Signal
from zerodp.comm import Comm
from zerodp.comm.faults.collective_order import CollectiveOrder
from zerodp.group_state import GradSync, GroupState, KeptGradient
from zerodp.parallel import ParallelDims
from zerodp.torch_internals import PlainTensorOps


@dataclass
class _RunningTask:
    """The reducer's view of the graph task now running."""

    is_boundary: bool
    contribution_scale: float  # multiplies contributions on their way in (see begin_task)
    rank_scale: float = 1.0  # the world size over the ranks contributing (see `rank_scale`)
    has_contributions: bool = False
    next_launch: int = 0  # groups before this index have been launched in this task
    held_back: frozenset[GroupState] = frozenset()  # launched and released at `settle` only
    unsettled: set[GroupState] = field(default_factory=set)  # held back, not yet settled


_kept = kept_gradient


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
        dims: ParallelDims,
        window: AccumulationWindow,
        *,
        comm_dtype: torch.dtype | None = None,
        max_inflight_elements: int,
        overlap_comm: bool,
        replicas: Comm | None = None,
        order: CollectiveOrder | None = None,
    ) -> None:
        self.plan = plan
        self.window = window
        self.comm_dtype = comm_dtype
        self.states = states
        self.on_contributions_complete: Signal[GroupState] = Signal()
        self._pool = BufferPool()
        self.queue = ReductionQueue(
            comm,
            plan,
            dims,
            self._pool,
            max_inflight_elements=max_inflight_elements,
            overlap_comm=overlap_comm,
            replicas=replicas,
            order=order,
        )
        self._task = _RunningTask(is_boundary=False, contribution_scale=1.0)
        self._held_back: frozenset[GroupState] = frozenset()
        # Reductions average over every data rank; when only some ranks contribute (a join
        # context averaging over the ranks still training) tasks scale by world / those.
        self.rank_scale = 1.0
        self.param_grads = ParamGradView(states) if plan.expose_param_grads else None

    @property
    def comm(self) -> Comm:
        """The shard group (every rank without replicas): where gradients are reduced."""
        return self.queue.comm

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

    def begin_task(self) -> None:
        """Prologue: every parameter's `.grad` must be None so that autograd starts afresh.

        The accumulation window says whether this task is the window's last (its sums
        are reduced) and what its gradients are multiplied by on their way in (see
        [Note: gradient factors] in `zerodp.backward.accumulation`).
        """
        window = self.window
        self._task = _RunningTask(
            is_boundary=window.task_reduces(),
            contribution_scale=window.contribution_factor(window.begin_task()),
            rank_scale=self.rank_scale,
            held_back=self._held_back,
            unsettled=set(self._held_back),
        )
        self.queue.across_now = self._task.is_boundary
        if self.param_grads is not None:
            self.param_grads.reclaim(self.plan.initial_sync)
        for state in self.states:
            _kept(state).task.reset()
            for param in state.params:
                param.grad = None

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
            self.queue.drain()
        for state in self.states:
            _kept(state).task.reset()
        self._pool.release_idle()
        self._show_param_grads()

    def abort_task(self) -> None:
        """A task died part-way: wait for what was launched, drop what was collected."""
        self.queue.across_now = False  # nothing new is issued on the way out
        self.queue.drain()
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
        queue = self.queue
        queue.across_now = True
        for state in self.states:
            sync = _kept(state).sync
            if sync is GradSync.LOCAL:
                queue.launch_in_place(state)
            elif sync is GradSync.PARTIAL:
                queue.launch_across(state, LaunchKind.IN_PLACE_ACROSS, None)
        queue.drain()
        queue.across_now = False
        self._show_param_grads()

    def zero(self) -> None:
        self.queue.drain()
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
            return self.queue.average_now(state, kept.storage[start:end].clone()).view(shape)
        if self.plan.reduces_whole_buffer:
            return kept.storage[start:end].clone().view(shape)
        gathered = torch.empty(
            flat.padded_numel, dtype=kept.storage.dtype, device=kept.storage.device
        )
        state.comm.all_gather(gathered, kept.shard_of_storage())
        part = gathered[start:end].clone()
        if kept.sync is GradSync.PARTIAL:
            part = self.queue.across_replicas_now(part)
        return part.view(shape)

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
                self.queue.launch_in_place(state)
            return
        bucket = self._bucket_for(kept)
        self._zero_unwritten(kept, bucket)
        kept.task.bucket = None
        self.queue.launch_bucket(state, bucket)

    def _reopen(self, state: GroupState) -> None:
        """A contribution after the group was launched in this task (a nested task's).

        Everything launched up to the group's last reduction in flight is finished, in
        order (a reduction across replicas follows its shard group's, so it may be
        launched while finishing): the group has nothing in flight when it reopens.
        """
        self.queue.finish_through(state)
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
