"""Gradient reduction: each rank's local gradient, averaged over ranks, where the stage keeps it.

[Note: gradient reduction]
Autograd accumulates a parameter's gradient for one graph task into a fresh
`param.grad` (zerodp keeps `param.grad` at None while a task runs); the
parameter's post-accumulate hook hands it to `contribute`, which moves it into
zerodp's own storage and drops `param.grad` again. So every graph task's
contribution is seen exactly once, whichever way backward was called.

Where a contribution goes depends on the group's `GradMode`:
- LOCAL (stages 0 and 1, between accumulation boundaries): added straight into
  the full gradient buffer, which then holds this rank's unreduced sum. At a
  boundary task the buffer is reduced in place (all-reduce at stage 0,
  reduce-scatter at stage 1) and the group becomes REDUCED.
- REDUCED (stages 2 and 3 always; stages 0 and 1 after a reduction until
  `zero_grad()`): copied into a bucket, the bucket is reduced, and the
  averaged result is added to the storage. So a second backward on a retained
  graph, before or after a boundary, adds its own averaged contribution, and
  gradients add up across backward passes until `zero_grad()`, as in PyTorch.

Collectives are launched in one fixed group order on every rank (a group
waits for the groups before it), so ranks whose autograd fires hooks in a
different order still issue identical collective sequences. Groups that got no
contribution on this rank are still reduced (with zeros) at the task's end
when the task produced any gradient at all: every rank must run the same
backward calls over the same parameters, as with DDP. A task that produced no
gradient (`torch.autograd.grad`) reduces and finalizes nothing.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from zerodp.backward.buffers import BufferPool
from zerodp.comm import Comm, Handle
from zerodp.partition import FlatGroup


class GradStorage(enum.Enum):
    FULL = "full"  # every rank keeps the whole group's gradient (stages 0, 1)
    SHARD = "shard"  # every rank keeps its shard only (stages 2, 3)


class FullReduce(enum.Enum):
    ALL_REDUCE = "all_reduce"  # stage 0: the whole buffer is averaged everywhere
    REDUCE_SCATTER = "reduce_scatter"  # stage 1: each rank averages its own shard


class GradMode(enum.Enum):
    LOCAL = "local"
    REDUCED = "reduced"


@dataclass(frozen=True)
class ReductionPlan:
    storage: GradStorage
    full_reduce: FullReduce
    defer_to_boundary: bool  # LOCAL accumulation between boundaries (stages 0, 1)
    expose_param_grads: bool  # `param.grad` shows the stored gradient (stage 0)
    optimizer_owns_full_group: bool  # stage 0: each rank steps the whole group


class _LaunchKind(enum.Enum):
    IN_PLACE = "in_place"
    BUCKET = "bucket"


@dataclass
class _InFlight:
    grads: GroupGradients
    kind: _LaunchKind
    handle: Handle
    bucket: torch.Tensor | None


class GroupGradients:
    """The gradient storage of one trainable FlatGroup, and its state in the running task."""

    def __init__(
        self, group: FlatGroup, plan: ReductionPlan, storage_dtype: torch.dtype, order: int
    ) -> None:
        self.group = group
        self.order = order
        numel = group.padded_numel if plan.storage is GradStorage.FULL else group.shard_numel
        self.storage = torch.zeros(numel, dtype=storage_dtype, device=group.device)
        self.mode = GradMode.LOCAL if plan.defer_to_boundary else GradMode.REDUCED
        self.num_params = len(group.params)
        # Per graph task:
        self.contributed = [False] * self.num_params
        self.num_contributed = 0
        self.launched = False
        self.bucket: torch.Tensor | None = None
        self.bucket_written = [False] * self.num_params

    def reset_task(self) -> None:
        self.contributed = [False] * self.num_params
        self.num_contributed = 0
        self.launched = False

    @property
    def complete(self) -> bool:
        return self.num_contributed == self.num_params


class GradientReducer:
    def __init__(
        self,
        groups: list[FlatGroup],
        comm: Comm,
        plan: ReductionPlan,
        *,
        storage_dtype: torch.dtype | None = None,
        comm_dtype: torch.dtype | None = None,
        max_inflight_elements: int,
        overlap_comm: bool,
    ) -> None:
        self.comm = comm
        self.plan = plan
        self.overlap_comm = overlap_comm
        self.max_inflight_elements = max(1, max_inflight_elements)
        self.comm_dtype = comm_dtype
        trainable = [g for g in groups if g.trainable]
        self.groups = [
            GroupGradients(g, plan, storage_dtype or g.dtype, order)
            for order, g in enumerate(trainable)
        ]
        self._where: dict[int, tuple[GroupGradients, int]] = {}
        for grads in self.groups:
            for position, param in enumerate(grads.group.params):
                self._where[id(param)] = (grads, position)
        self._pool = BufferPool()
        self._inflight: deque[_InFlight] = deque()
        self._inflight_elements = 0
        self._next_launch = 0
        self._task_boundary = False
        self._contribution_scale = 1.0
        self._task_has_contributions = False
        self._grads_exposed = False
        self.on_group_complete: list = []  # callbacks(FlatGroup), e.g. stage 3 releases

    # -- queries -------------------------------------------------------------------

    def manages(self, param: nn.Parameter) -> bool:
        return id(param) in self._where

    def grads_of(self, group: FlatGroup) -> GroupGradients:
        for grads in self.groups:
            if grads.group is group:
                return grads
        raise KeyError(f"{group} has no gradients (frozen)")

    @property
    def any_local(self) -> bool:
        return any(g.mode is GradMode.LOCAL for g in self.groups)

    # -- the graph task --------------------------------------------------------------

    def begin_task(self, is_boundary: bool, contribution_scale: float = 1.0) -> None:
        """Prologue: take `param.grad` out of autograd's way so it accumulates fresh.

        `contribution_scale` multiplies this task's gradients on their way in: the
        fp16 loss scale for a backward whose loss was not scaled, so that every
        kept gradient carries the same scale.
        """
        self._task_boundary = is_boundary
        self._contribution_scale = contribution_scale
        self._task_has_contributions = False
        self._next_launch = 0
        for grads in self.groups:
            grads.reset_task()
            if self._grads_exposed:
                self._adopt_user_grads(grads)
            else:
                for param in grads.group.params:
                    param.grad = None
        self._grads_exposed = False

    def contribute(self, param: nn.Parameter) -> None:
        """Post-accumulate hook: move this task's gradient of `param` into zerodp's storage."""
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        grads, position = self._where[id(param)]
        flat_grad = grad.detach().reshape(-1)
        if self._contribution_scale != 1.0:
            flat_grad = flat_grad * self._contribution_scale
        self._task_has_contributions = True
        if grads.launched:
            self._reopen(grads)
        start, end = grads.group.slot_of(position)
        if grads.mode is GradMode.LOCAL:
            grads.storage[start:end].add_(flat_grad)
        else:
            bucket = self._bucket_for(grads)
            if grads.bucket_written[position]:
                bucket[start:end].add_(flat_grad)
            else:
                bucket[start:end].copy_(flat_grad)
                grads.bucket_written[position] = True
        if not grads.contributed[position]:
            grads.contributed[position] = True
            grads.num_contributed += 1
            if grads.complete:
                self._launch_ready()
                for callback in self.on_group_complete:
                    callback(grads.group)

    def end_task(self) -> None:
        """Epilogue: reduce what the task left unreduced, wait for every reduction."""
        if self._task_has_contributions:
            for grads in self.groups:
                if not grads.launched:
                    self._launch(grads)
            self._drain()
        self._expose_if_needed()
        for grads in self.groups:
            grads.reset_task()

    def abort_task(self) -> None:
        """A task died part-way: wait for what was launched, drop what was collected."""
        self._drain()
        for grads in self.groups:
            if grads.bucket is not None:
                self._pool.give_back(grads.bucket)
                grads.bucket = None
            grads.reset_task()
            for param in grads.group.params:
                param.grad = None
        self._expose_if_needed()

    # -- outside backward --------------------------------------------------------------

    def reduce_local(self) -> None:
        """Reduce groups still holding local sums (a boundary step without a boundary task)."""
        for grads in self.groups:
            if grads.mode is GradMode.LOCAL:
                self._launch_in_place(grads)
        self._drain()
        self._expose_if_needed()

    def zero(self) -> None:
        self._drain()
        for grads in self.groups:
            grads.storage.zero_()
            grads.mode = GradMode.LOCAL if self.plan.defer_to_boundary else GradMode.REDUCED
            if not self.plan.expose_param_grads:
                for param in grads.group.params:
                    param.grad = None
        self._expose_if_needed()

    def owned_grad(self, grads: GroupGradients) -> torch.Tensor:
        """The averaged gradient of the range this rank's optimizer steps."""
        if self.plan.optimizer_owns_full_group or self.plan.storage is GradStorage.SHARD:
            return grads.storage
        start, end = grads.group.shard_range
        return grads.storage[start:end]

    def full_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The full rank-averaged gradient of `param` (a collective: every rank calls it)."""
        grads, position = self._where[id(param)]
        start, end = grads.group.slot_of(position)
        shape = grads.group.layout.slots[position].shape
        if grads.mode is GradMode.LOCAL:
            local = grads.storage[start:end].clone()
            self.comm.all_reduce(local)
            return local.div_(self.comm.world_size).view(shape)
        if self.plan.storage is GradStorage.FULL and (
            self.plan.full_reduce is FullReduce.ALL_REDUCE
        ):
            return grads.storage[start:end].clone().view(shape)
        gathered = torch.empty(
            grads.group.padded_numel, dtype=grads.storage.dtype, device=grads.storage.device
        )
        self.comm.all_gather(gathered, self.owned_grad(grads))
        return gathered[start:end].clone().view(shape)

    # -- launching -------------------------------------------------------------------

    def _launch_ready(self) -> None:
        """Launch, in the fixed group order, every group whose turn has come."""
        while self._next_launch < len(self.groups):
            grads = self.groups[self._next_launch]
            if grads.launched:
                self._next_launch += 1
                continue
            if not grads.complete:
                return
            self._launch(grads)
            self._next_launch += 1

    def _launch(self, grads: GroupGradients) -> None:
        grads.launched = True
        if grads.mode is GradMode.LOCAL:
            if self._task_boundary:
                self._launch_in_place(grads)
            return
        bucket = self._bucket_for(grads)
        self._zero_unwritten(grads, bucket)
        grads.bucket = None
        self._make_room(bucket.numel())
        if self._reduces_whole_buffer():
            handle = self.comm.all_reduce(bucket, async_op=self.overlap_comm)
        else:
            start, end = grads.group.shard_range
            handle = self.comm.reduce_scatter(bucket[start:end], bucket, async_op=self.overlap_comm)
        self._track(_InFlight(grads, _LaunchKind.BUCKET, handle, bucket))

    def _launch_in_place(self, grads: GroupGradients) -> None:
        storage = grads.storage
        if self.plan.full_reduce is FullReduce.ALL_REDUCE:
            handle = self.comm.all_reduce(storage, async_op=self.overlap_comm)
        else:
            start, end = grads.group.shard_range
            handle = self.comm.reduce_scatter(
                storage[start:end], storage, async_op=self.overlap_comm
            )
        self._track(_InFlight(grads, _LaunchKind.IN_PLACE, handle, None))

    def _reduces_whole_buffer(self) -> bool:
        return self.plan.storage is GradStorage.FULL and (
            self.plan.full_reduce is FullReduce.ALL_REDUCE
        )

    def _track(self, inflight: _InFlight) -> None:
        self._inflight.append(inflight)
        self._inflight_elements += inflight.grads.group.padded_numel
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
        self._inflight_elements -= inflight.grads.group.padded_numel
        inflight.handle.wait()
        grads = inflight.grads
        world_size = self.comm.world_size
        if inflight.kind is _LaunchKind.IN_PLACE:
            if self.plan.full_reduce is FullReduce.ALL_REDUCE:
                grads.storage.div_(world_size)
            else:
                start, end = grads.group.shard_range
                grads.storage[start:end].div_(world_size)
            grads.mode = GradMode.REDUCED
            return
        bucket = inflight.bucket
        if bucket is None:  # pragma: no cover - a bucket launch always carries its bucket
            raise RuntimeError("internal error: bucket reduction without a bucket")
        if self._reduces_whole_buffer():
            grads.storage.add_(bucket.div_(world_size))
        else:
            start, end = grads.group.shard_range
            self.owned_grad(grads).add_(bucket[start:end].div_(world_size))
        self._pool.give_back(bucket)

    def _reopen(self, grads: GroupGradients) -> None:
        """A contribution after the group was launched in this task (a nested task's)."""
        for index, inflight in enumerate(self._inflight):
            if inflight.grads is grads:
                # Finish everything launched up to it, in order.
                for _ in range(index + 1):
                    self._finalize_oldest()
                break
        grads.launched = False

    def _bucket_for(self, grads: GroupGradients) -> torch.Tensor:
        if grads.bucket is None:
            dtype = self.comm_dtype or grads.group.dtype
            grads.bucket = self._pool.take(grads.group.padded_numel, dtype, grads.group.device)
            grads.bucket_written = [False] * grads.num_params
        return grads.bucket

    @staticmethod
    def _zero_unwritten(grads: GroupGradients, bucket: torch.Tensor) -> None:
        for position, written in enumerate(grads.bucket_written):
            if not written:
                start, end = grads.group.slot_of(position)
                bucket[start:end].zero_()
        bucket[grads.group.numel :].zero_()

    # -- param.grad at stage 0 ---------------------------------------------------------

    def _adopt_user_grads(self, grads: GroupGradients) -> None:
        """Stage 0 shows gradients as `param.grad`; take in what the user did to them."""
        all_none = True
        for position, param in enumerate(grads.group.params):
            start, end = grads.group.slot_of(position)
            region = grads.storage[start:end]
            user_grad = param.grad
            if user_grad is None:
                region.zero_()
            else:
                all_none = False
                if user_grad.data_ptr() != region.data_ptr():
                    region.copy_(user_grad.detach().reshape(-1))
            param.grad = None
        if all_none and self.plan.defer_to_boundary:
            grads.mode = GradMode.LOCAL

    def _expose_if_needed(self) -> None:
        """Stage 0: `param.grad` becomes a view of the kept gradient (when dtypes agree)."""
        if not self.plan.expose_param_grads or any(
            g.storage.dtype != g.group.dtype for g in self.groups
        ):
            return
        for grads in self.groups:
            for position, param in enumerate(grads.group.params):
                start, end = grads.group.slot_of(position)
                param.grad = grads.storage[start:end].view_as(param)
        self._grads_exposed = True
