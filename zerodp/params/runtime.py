"""Stage 3, wired: sharded groups, their coordinator, the hooks that drive it."""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.comm import Comm
from zerodp.params import zero_parameter
from zerodp.params.coordinator import ParamCoordinator
from zerodp.params.module_hooks import Stage3ModuleHooks
from zerodp.params.saved_tensors import SavedTensorGatherer
from zerodp.params.sharded_group import ShardedGroup
from zerodp.params.status import ParamStatus
from zerodp.partition import FlatGroup
from zerodp.partition.builder import ModelLayout


class Stage3Runtime:
    def __init__(
        self,
        root: nn.Module,
        layout: ModelLayout,
        comm: Comm,
        lifecycle: BackwardLifecycle,
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int,
    ) -> None:
        self.sharded = [
            ShardedGroup(flat, comm, persistent)
            for flat, persistent in zip(layout.groups, layout.persistent, strict=True)
        ]
        by_flat = {id(g.flat): g for g in self.sharded}
        module_groups: dict[nn.Module, list[ShardedGroup]] = {}
        for module, direct in layout.module_params.items():
            groups: list[ShardedGroup] = []
            for param in direct:
                flat = layout.group_of(param)
                if flat is None:
                    continue
                group = by_flat[id(flat)]
                if not group.persistent and group not in groups:
                    groups.append(group)
            if groups:
                module_groups[module] = groups
        self.coordinator = ParamCoordinator(
            self.sharded,
            module_groups,
            prefetch_numel=prefetch_numel,
            max_live_numel=max_live_numel,
            max_reuse_distance=max_reuse_distance,
        )
        self.saved_tensors = SavedTensorGatherer(self.coordinator)
        self._handles: list[RemovableHandle] = Stage3ModuleHooks(
            root, self.coordinator, lifecycle, self.saved_tensors
        ).install()
        self._handles += [
            lifecycle.on_prologue(lambda task: self.coordinator.begin_backward()),
            lifecycle.on_epilogue(lambda task: self.coordinator.end_backward()),
            lifecycle.on_abort(lambda task: self.coordinator.abort()),
        ]
        for group in self.sharded:
            if not group.persistent:
                for param in group.flat.params:
                    zero_parameter.adopt(param, self.coordinator)

    def resident_groups(self) -> list[FlatGroup]:
        """Trainable groups whose full buffer is present now (refreshed after a step).

        Groups a forward kept for its backward are released first: after a step only
        persistent groups (and groups someone holds) are gathered.
        """
        self.coordinator.release_all()
        resident = []
        for group in self.sharded:
            if not group.flat.trainable:
                continue
            if group.status is ParamStatus.INFLIGHT:
                group.to_available()
            if group.status is ParamStatus.AVAILABLE:
                resident.append(group.flat)
        return resident

    def group_of(self, param: nn.Parameter) -> ShardedGroup | None:
        return self.coordinator.group_of(param)

    def teardown(self) -> None:
        """Gather everything and leave plain, whole parameters behind."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for group in self.sharded:
            group.to_available()
            group.holds = 0
            for param in group.flat.params:
                zero_parameter.release(param)
