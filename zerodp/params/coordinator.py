"""When stage 3 groups are gathered and released.

The coordinator owns every `ShardedGroup` and is told what happens by the
module hooks (`zerodp.params.module_hooks`), the saved-tensor hooks, the
parameters themselves (`ZeroParameter`) and the backward lifecycle:

- forward: a module's groups are gathered before it runs and held until it
  returns; a group the module uses that belongs to another module (a parent
  using a child's weight) is gathered on use, and remembered, so that later
  forwards gather it up front and its backward gathers it too;
- backward: a module's groups are gathered when the gradient of its output
  arrives, and released once the gradients of its inputs are computed, or
  once the gradients of all the group's parameters are accumulated; whatever
  is still gathered is released by the task's epilogue (or its abort);
- a forward re-run inside backward (activation checkpointing) gathers but does
  not release: the backward about to run needs the parameters.

Only groups nobody holds are released. `live_numel` counts gathered
elements, `peak_live_numel` its maximum since `reset_peak()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerodp.backward import autograd_api
from zerodp.errors import ParamStateError
from zerodp.params import zero_parameter
from zerodp.params.prefetch import ExecutionTrace
from zerodp.params.sharded_group import ShardedGroup
from zerodp.params.status import ParamStatus
from zerodp.partition import FlatGroup


@dataclass
class _Scope:
    module: nn.Module
    in_backward: bool
    held: list[ShardedGroup] = field(default_factory=list)


class ParamCoordinator:
    def __init__(
        self,
        groups: list[ShardedGroup],
        module_groups: dict[nn.Module, list[ShardedGroup]],
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int = 0,
    ) -> None:
        self.groups = groups
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self._by_param: dict[int, ShardedGroup] = {}
        self._by_flat: dict[int, ShardedGroup] = {}
        self._by_storage: dict[int, ShardedGroup] = {}
        for group in groups:
            self._by_flat[id(group.flat)] = group
            for param in group.flat.params:
                self._by_param[id(param)] = group
            if not group.persistent:
                self._by_storage[group.flat.storage_key()] = group
        self._module_groups = {id(m): list(gs) for m, gs in module_groups.items()}
        self._external: dict[int, list[ShardedGroup]] = {}
        self._scopes: list[_Scope] = []
        self.live_numel = 0
        self.peak_live_numel = 0
        self.num_prefetched = 0  # groups gathered ahead of their use
        self.forward_trace: ExecutionTrace[ShardedGroup] = ExecutionTrace()
        self.backward_trace: ExecutionTrace[ShardedGroup] = ExecutionTrace()
        self._backward_head: set[int] = set()  # groups the backward uses first

    # -- queries -------------------------------------------------------------------

    def group_of(self, param: nn.Parameter) -> ShardedGroup | None:
        return self._by_param.get(id(param))

    def group_of_storage(self, storage_key: int) -> ShardedGroup | None:
        return self._by_storage.get(storage_key)

    def status(self, param: nn.Parameter) -> ParamStatus:
        group = self._by_param.get(id(param))
        return ParamStatus.AVAILABLE if group is None else group.status

    def groups_of_module(self, module: nn.Module) -> list[ShardedGroup]:
        key = id(module)
        direct = self._module_groups.get(key, [])
        external = self._external.get(key)
        return direct + external if external else direct

    def has_groups(self, module: nn.Module) -> bool:
        return bool(self._module_groups.get(id(module)) or self._external.get(id(module)))

    def reset_peak(self) -> None:
        self.peak_live_numel = self.live_numel

    # -- forward -------------------------------------------------------------------

    def begin_forward(self) -> None:
        self._release_unheld()  # what a forward kept for a backward that never came
        self.forward_trace.begin_pass()
        self._backward_head = self._first_backward_groups()

    def end_forward(self, backward_follows: bool) -> None:
        """Release what the forward gathered, except what its backward would prefetch first.

        The groups a forward ends with (an output layer, an embedding tied to it) are the
        ones its backward starts with: when a backward can follow (grad mode on), groups
        within the backward's first `stage3_prefetch_bucket_size` elements stay gathered
        instead of being released and gathered straight back. `release_all()` (at
        `step()`, the next forward, or the backward's end) lets them go.
        """
        self.forward_trace.end_pass()
        # Until a backward has been recorded, expect it to run the forward in reverse, so
        # that the first backward prefetches like every later one.
        self.backward_trace.seed(self.forward_trace.recorded[::-1])
        keep = self._backward_head if backward_follows else set()
        for group in self.groups:
            if id(group) not in keep or self.live_numel > self.max_live_numel:
                self._release(group)

    def release_all(self) -> None:
        """Release every group nobody holds (before an optimizer step, for instance)."""
        self._release_unheld()

    def _first_backward_groups(self) -> set[int]:
        kept: set[int] = set()
        budget = self.prefetch_numel
        for group in self.backward_trace.recorded:
            if budget <= 0:
                break
            if id(group) not in kept:
                kept.add(id(group))
                budget -= group.numel
        return kept

    def pre_forward(self, module: nn.Module) -> None:
        scope = _Scope(module, in_backward=autograd_api.in_backward())
        self._scopes.append(scope)
        trace = self.backward_trace if scope.in_backward else self.forward_trace
        for group in self.groups_of_module(module):
            self._gather(group, trace)
            if not scope.in_backward:
                group.holds += 1
                scope.held.append(group)

    def post_forward(self, module: nn.Module) -> None:
        if not self._scopes or self._scopes[-1].module is not module:
            # A forward raised part-way and left scopes behind: drop them.
            self._unwind_to(module)
        if not self._scopes:
            return
        scope = self._scopes.pop()
        for group in scope.held:
            group.holds -= 1
            self._release_unless_reused(group, self.forward_trace)

    # -- backward ------------------------------------------------------------------

    def begin_backward(self) -> None:
        self.backward_trace.begin_pass()

    def pre_backward(self, module: nn.Module) -> None:
        for group in self.groups_of_module(module):
            self._gather(group, self.backward_trace)

    def post_backward(self, module: nn.Module) -> None:
        for group in self.groups_of_module(module):
            self._release_unless_reused(group, self.backward_trace)

    def on_grads_complete(self, flat: FlatGroup) -> None:
        group = self._by_flat.get(id(flat))
        if group is not None:
            self._release(group)

    def end_backward(self) -> None:
        self.backward_trace.end_pass()
        self._release_unheld()

    def abort(self) -> None:
        """A forward or backward died part-way: release everything, forget all scopes."""
        self._scopes.clear()
        for group in self.groups:
            group.holds = 0
        self._release_unheld()

    # -- gathering on use ------------------------------------------------------------

    def before_use(self, param: nn.Parameter, func: Callable[..., Any]) -> None:
        """A torch operation is about to read `param` (called by ZeroParameter)."""
        group = self._by_param.get(id(param))
        if group is None:
            return
        if zero_parameter.is_data_property(func) and getattr(func, "__name__", "") == "__set__":
            raise ParamStateError(
                "assigning `.data` of a ZeRO stage 3 parameter would detach it from its "
                "shard; write into it instead (`param.copy_(value)` inside "
                "zerodp.zero.GatheredParameters([param], modifier_rank=0))"
            )
        if group.status is ParamStatus.AVAILABLE:
            return
        if self._scopes:
            scope = self._scopes[-1]
            self._gather(group, trace=None)
            if not scope.in_backward:
                group.holds += 1
                scope.held.append(group)
                self._remember_external(scope.module, group)
            return
        if autograd_api.in_backward():
            self._gather(group, trace=None)
            return
        position = next(i for i, p in enumerate(group.flat.params) if p is param)
        raise ParamStateError(
            f"parameter '{group.flat.names[position]}' is sharded by "
            "ZeRO stage 3 and is not gathered outside the model's forward and backward; "
            "read or modify it inside `with zerodp.zero.GatheredParameters([param]):` "
            "(every rank must enter it), or use zerodp.utils.safe_get_full_fp32_param"
        )

    def ensure_available_for_unpack(self, group: ShardedGroup) -> None:
        """Autograd unpacks a saved tensor that shares `group`'s storage."""
        if group.status is not ParamStatus.AVAILABLE:
            self._gather(group, trace=None)

    # -- held blocks (GatheredParameters) ---------------------------------------------

    def hold(self, group: ShardedGroup) -> None:
        self._gather(group, trace=None)
        group.holds += 1

    def unhold(self, group: ShardedGroup) -> None:
        group.holds = max(0, group.holds - 1)
        self._release(group)

    # -- internals -----------------------------------------------------------------

    def _gather(self, group: ShardedGroup, trace: ExecutionTrace[ShardedGroup] | None) -> None:
        if group.status is ParamStatus.NOT_AVAILABLE:
            self._count_in(group)
            group.to_inflight()
        upcoming = trace.request(group) if trace is not None else []
        if upcoming:
            self._prefetch(upcoming)
        group.to_available()

    def _prefetch(self, upcoming: list[ShardedGroup]) -> None:
        budget = self.prefetch_numel
        seen: set[int] = set()
        for group in upcoming:
            if budget <= 0:
                return
            if id(group) in seen:
                continue
            seen.add(id(group))
            if group.status is not ParamStatus.NOT_AVAILABLE:
                continue
            if self.live_numel + group.numel > self.max_live_numel:
                return
            self._count_in(group)
            group.to_inflight()
            self.num_prefetched += 1
            budget -= group.numel

    def _release_unless_reused(
        self, group: ShardedGroup, trace: ExecutionTrace[ShardedGroup]
    ) -> None:
        """Keep a group the rest of this pass uses again within `max_reuse_distance`.

        Tied weights (an embedding reused as the output layer) and modules called
        twice would otherwise be gathered once per use; the distance counts the
        elements other groups gather in between. The pass's end releases it.
        """
        if self.live_numel > self.max_live_numel:
            self._release(group)  # over stage3_max_live_parameters: keep nothing extra
            return
        distance = 0
        upcoming = trace.upcoming()
        for later in upcoming:
            if later is group:
                return
            distance += later.numel
            if distance > self.max_reuse_distance:
                break
        if (
            trace is self.forward_trace
            and torch.is_grad_enabled()
            and id(group) in self._backward_head
            and sum(g.numel for g in upcoming) <= self.prefetch_numel
        ):
            return  # the forward is ending and its backward starts with this group
        self._release(group)

    def _release(self, group: ShardedGroup) -> None:
        if group.release_if_unused():
            self.live_numel -= group.numel

    def _release_unheld(self) -> None:
        for group in self.groups:
            self._release(group)

    def _count_in(self, group: ShardedGroup) -> None:
        self.live_numel += group.numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _remember_external(self, module: nn.Module, group: ShardedGroup) -> None:
        if group in self._module_groups.get(id(module), []):
            return
        external = self._external.setdefault(id(module), [])
        if group not in external:
            external.append(group)

    def _unwind_to(self, module: nn.Module) -> None:
        while self._scopes and self._scopes[-1].module is not module:
            scope = self._scopes.pop()
            for group in scope.held:
                group.holds -= 1
                self._release(group)
