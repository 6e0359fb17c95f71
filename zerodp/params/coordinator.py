"""When stage 3 groups are gathered and released.

The coordinator decides for every sharded group (`GroupState.gather`) and is
told what happens by the module hooks (`zerodp.params.module_hooks`), the
saved-tensor hooks, the parameters themselves (`ZeroParameter`) and the
backward lifecycle:

- forward: a module's groups are gathered before it runs and held until it
  returns; a group the module uses that belongs to another module (a parent
  using a child's weight) is gathered on use, and remembered, so that later
  forwards gather it up front and its backward gathers it too; a module that
  holds groups runs with the saved-tensor hooks ([Note: saving windows]);
- backward: a module's groups are gathered when the gradient of its output
  arrives, and released once the gradients of its inputs are computed, or
  once the gradients of all the group's parameters are accumulated; whatever
  is still gathered is released by the task's epilogue (or its abort);
- a forward re-run inside backward (activation checkpointing) gathers but does
  not release: the backward about to run needs the parameters;
- a leaf module (see [Note: leaf modules]) is one unit: its groups are those
  of every module in its subtree, gathered when it is entered and released
  when it is done, in forward and in backward; when its backward is done,
  `settle` tells the reducer that its groups' gradients are all in.

Only groups nobody holds are released. `live_numel` counts gathered
elements (kept by `_count_in`/`_release`, the only places that change a
group's allocation); `peak_live_numel` is its maximum since `reset_peak()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from zerodp.backward import autograd_api
from zerodp.comm.faults.collective_order import CollectiveOrder
from zerodp.errors import ParamStateError
from zerodp.group import GatherState, GroupIndex, GroupState, ParamStatus
from zerodp.params.leaf import LeafPlan
from zerodp.params.prefetch import ExecutionTrace
from zerodp.torch_internals import same_tensor_view, storage_key


@dataclass
class _Scope:
    module: nn.Module
    in_backward: bool
    held: list[GroupState] = field(default_factory=list)
    saving: bool = False  # this scope installed the saved-tensor hooks


class SavingWindows(Protocol):
    """The saved-tensor hooks, as forward scopes install them ([Note: saving windows])."""

    def push_if_possible(self) -> bool: ...

    def pop(self) -> None: ...


class LeafGradients(Protocol):
    """The reducer, as leaf modules need it (see [Note: leaf modules])."""

    def hold_back(self, states: frozenset[GroupState]) -> None: ...

    def settle(self, states: list[GroupState]) -> None: ...


def _numel_of(state: GroupState) -> int:
    return state.sharded_gather.numel


class ParamCoordinator:
    """Gathers and releases the sharded groups of one engine, prefetching in recorded order."""

    def __init__(
        self,
        index: GroupIndex,
        module_groups: dict[nn.Module, list[GroupState]],
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int = 0,
        root: nn.Module | None = None,
        gradients: LeafGradients | None = None,
    ) -> None:
        self.index = index
        self.states = index.sharded
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self._by_storage = {storage_key(s.flat.full): s for s in self.states}
        self._module_groups = {m: list(states) for m, states in module_groups.items()}
        self.leaves = LeafPlan(
            root if root is not None else nn.Module(),
            self._module_groups,
            on_change=gradients.hold_back if gradients is not None else None,
        )
        self._gradients = gradients
        self.order: CollectiveOrder | None = None  # checks every gather's place, if set
        self.windows: SavingWindows | None = None  # the saved-tensor hooks, once installed
        self._external: dict[nn.Module, list[GroupState]] = {}
        self._scopes: list[_Scope] = []
        self.live_numel = 0
        self.peak_live_numel = 0
        self.num_prefetched = 0  # groups gathered ahead of their use
        self.forward_trace: ExecutionTrace[GroupState] = ExecutionTrace(_numel_of)
        self.backward_trace: ExecutionTrace[GroupState] = ExecutionTrace(_numel_of)
        self._backward_head: set[GroupState] = set()  # groups the backward uses first

    # -- queries -------------------------------------------------------------------

    def state_of_storage(self, key: int) -> GroupState | None:
        """The sharded group whose full buffer has this storage (see `storage_key`)."""
        return self._by_storage.get(key)

    def groups_of_module(self, module: nn.Module) -> list[GroupState]:
        """The groups gathered for `module`: its own (a leaf's whole subtree's), and those
        of other modules it was seen using."""
        if self.leaves.is_leaf(module):
            direct = self.leaves.subtree_groups(module)
        else:
            direct = self._module_groups.get(module, [])
        external = self._external.get(module)
        return direct + external if external else direct

    def owns_groups(self, module: nn.Module) -> bool:
        """Whether `module` has sharded groups of its own (a unit: its subtree's)."""
        return bool(self._module_groups.get(module))

    def has_groups(self, module: nn.Module) -> bool:
        if self._external.get(module):
            return True
        if self.leaves.is_leaf(module):
            return bool(self.leaves.subtree_groups(module))
        return bool(self._module_groups.get(module))

    def reset_peak(self) -> None:
        self.peak_live_numel = self.live_numel

    # -- forward -------------------------------------------------------------------

    def begin_forward(self) -> None:
        if self.order is not None:
            self.order.begin("forward")
        self.release_unheld()  # what a forward kept for a backward that never came
        self._set_forward_pass(True)
        self.forward_trace.begin_pass()
        self._backward_head = self._first_backward_groups()

    def end_forward(self, backward_follows: bool) -> None:
        """Release what the forward gathered, except what its backward would prefetch first.

        The groups a forward ends with (an output layer, an embedding tied to it) are the
        ones its backward starts with: when a backward can follow (grad mode on), groups
        within the backward's first `stage3_prefetch_bucket_size` elements stay gathered
        instead of being released and gathered straight back. `release_unheld()` (at
        `step()`, the next forward, or the backward's end) lets them go.
        """
        self.forward_trace.end_pass()
        # Until a backward has been recorded, expect it to run the forward in reverse, so
        # that the first backward prefetches like every later one.
        self.backward_trace.seed(self.forward_trace.recorded[::-1])
        for state in self.states:
            if not (backward_follows and self._keeps_for_backward(state, ahead=0)):
                self._release(state)
        self._set_forward_pass(False)
        if self.order is not None:
            self.order.end()

    def fail_forward(self, error: BaseException) -> None:
        """The forward raised `error` on this rank: release what it gathered, and tell the
        other ranks, which wait for its part of the pass ([Note: failure notices])."""
        if self.order is not None:
            self.order.fail(error)
        self.abort()

    def release_unheld(self) -> None:
        """Release every group nobody holds (before an optimizer step, for instance)."""
        for state in self.states:
            self._release(state)

    def _first_backward_groups(self) -> set[GroupState]:
        kept: set[GroupState] = set()
        budget = self.prefetch_numel
        for state in self.backward_trace.recorded:
            if budget <= 0:
                break
            if state not in kept:
                kept.add(state)
                budget -= state.sharded_gather.numel
        return kept

    def pre_forward(self, module: nn.Module) -> None:
        scope = _Scope(module, in_backward=autograd_api.in_backward())
        self._scopes.append(scope)
        trace = self.backward_trace if scope.in_backward else self.forward_trace
        for state in self.groups_of_module(module):
            self._gather(state, trace)
            if not scope.in_backward:
                self._hold_for(scope, state)

    def post_forward(self, module: nn.Module) -> None:
        if not self._scopes or self._scopes[-1].module is not module:
            # A forward raised part-way and left scopes behind: drop them.
            self._unwind_to(module)
        if not self._scopes:
            return
        scope = self._scopes.pop()
        self._close(scope)
        for state in scope.held:
            self._release_unless_reused(state, self.forward_trace)

    # -- backward ------------------------------------------------------------------

    def begin_backward(self) -> None:
        if self.order is not None:
            self.order.begin("backward")
        self.backward_trace.begin_pass()

    def pre_backward(self, module: nn.Module) -> None:
        for state in self.groups_of_module(module):
            self._gather(state, self.backward_trace)

    def post_backward(self, module: nn.Module) -> None:
        for state in self.groups_of_module(module):
            self._release_unless_reused(state, self.backward_trace)

    def end_leaf_backward(self, leaf: nn.Module) -> None:
        """The backward of leaf `leaf` is done: its groups' gradients are in, they can go."""
        if self._gradients is not None:
            self._gradients.settle(self.leaves.subtree_groups(leaf))
        self.post_backward(leaf)

    def on_grads_complete(self, state: GroupState) -> None:
        """Every parameter of `state` has its gradient for this task: it can go.

        Never a leaf's group (the reducer holds those back): that is released when the
        leaf's backward is done, the same point on every rank (a rank may complete a
        group early, another never).
        """
        if state.gather is not None:
            self._release(state)

    def end_backward(self) -> None:
        self.backward_trace.end_pass()
        self.release_unheld()

    def end_backward_order(self) -> None:
        """The task's last collective (the reducer's, at its end) is issued: the pass is over."""
        if self.order is not None:
            self.order.end()

    def abort(self) -> None:
        """A forward or backward died part-way: release everything, forget all scopes."""
        while self._scopes:
            self._close(self._scopes.pop())
        for state in self.states:
            state.sharded_gather.drop_holds()
        self._set_forward_pass(False)
        self.release_unheld()
        if self.order is not None:
            self.order.abandon()

    # -- gathering on use ------------------------------------------------------------

    def before_use(self, param: nn.Parameter, func: Callable[..., Any]) -> None:
        """A torch operation is about to read `param` (called by ZeroParameter)."""
        state = self.index.state_of(param)
        if state is None or state.gather is None:
            return
        if state.gather.status is ParamStatus.AVAILABLE:
            # Gathered but guarded: a forward is running and no scope claims it (a group
            # kept for reuse, prefetched, or held by GatheredParameters). The running scope
            # claims it; nothing is gathered, so nothing changes the next forward's plan.
            if not state.gather.claims and self._scopes and not self._scopes[-1].in_backward:
                self._hold_for(self._scopes[-1], state)
            return
        if self._scopes:
            scope = self._scopes[-1]
            self._gather(state, trace=None)
            if not scope.in_backward:
                self._hold_for(scope, state)
                self._remember_external(scope.module, state)
            return
        if autograd_api.in_backward():
            self._gather(state, trace=None)
            return
        name = state.names[state.flat.position_of(param)]
        raise ParamStateError(
            f"parameter '{name}' is sharded by ZeRO stage 3 and is not gathered outside the "
            "model's forward and backward; read or modify it inside "
            "`with zerodp.zero.GatheredParameters([param]):` (every rank must enter it), or "
            "use zerodp.utils.safe_get_full_fp32_param; for the whole model use "
            "zerodp.zero.full_state_dict(model) and zerodp.zero.load_state_dict(model, ...) "
            "instead of model.state_dict() / load_state_dict()"
        )

    def assign_data(self, param: nn.Parameter, value: Any) -> None:
        """`param.data = value` after initialize: only a no-op (`module.to()` on its device)."""
        if same_tensor_view(param, value):
            return
        raise ParamStateError(
            "assigning `.data` of a ZeRO stage 3 parameter would detach it from its "
            "shard; write into it instead (`param.copy_(value)` inside "
            "zerodp.zero.GatheredParameters([param], modifier_rank=0)), or load weights with "
            "zerodp.zero.load_state_dict(model, ...)"
        )

    def ensure_available_for_unpack(self, state: GroupState) -> None:
        """Autograd unpacks a saved tensor that shares `state`'s full storage."""
        if state.sharded_gather.status is not ParamStatus.AVAILABLE:
            self._gather(state, trace=None)

    # -- held blocks (GatheredParameters) ---------------------------------------------

    def group_of(self, param: nn.Parameter) -> GroupState | None:
        state = self.index.state_of(param)
        return state if state is not None and state.gather is not None else None

    def hold(self, state: GroupState) -> None:
        self._gather(state, trace=None)
        state.sharded_gather.hold()

    def unhold(self, state: GroupState) -> None:
        state.sharded_gather.unhold()
        self._release(state)

    def hold_all(self, states: list[GroupState]) -> None:
        """Gather `states` with every gather in flight at once, then hold each.

        Callers pass groups in the same order on every rank (group order), as they
        would for `hold`; `unhold_all` undoes it.
        """
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
                self._release(state)

    def prefetch(self, state: GroupState) -> None:
        """Start gathering `state` without waiting for it (`hold_all` waits)."""
        gather = state.sharded_gather
        if gather.status is ParamStatus.NOT_AVAILABLE:
            self._issue(state, gather)
            self.num_prefetched += 1

    def release(self, state: GroupState) -> None:
        """Release `state` unless someone holds it (a gather in flight is finished first)."""
        self._release(state)

    def gather_all(self) -> None:
        """Gather every group (the engine is being torn down, parameters become whole)."""
        for state in self.states:
            self._gather(state, trace=None)

    # -- internals -----------------------------------------------------------------

    def _gather(self, state: GroupState, trace: ExecutionTrace[GroupState] | None) -> None:
        gather = state.sharded_gather
        if gather.status is ParamStatus.NOT_AVAILABLE:
            self._issue(state, gather)
        if trace is not None and trace.request(state):
            self._prefetch(trace)
        gather.to_available()

    def _prefetch(self, trace: ExecutionTrace[GroupState]) -> None:
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

    def _keeps_for_backward(self, state: GroupState, ahead: int) -> bool:
        """Whether the backward about to follow starts with `state` (so it stays gathered).

        The one rule for "the backward's head": `state` is among the groups the
        recorded backward uses first, what the forward still has to run (`ahead`
        elements) fits in the prefetch budget, and the live cap leaves room.
        """
        return (
            state in self._backward_head
            and self.live_numel <= self.max_live_numel
            and ahead <= self.prefetch_numel
        )

    def _release_unless_reused(self, state: GroupState, trace: ExecutionTrace[GroupState]) -> None:
        """Keep a group the rest of this pass uses again within `max_reuse_distance`.

        Tied weights (an embedding reused as the output layer) and modules called
        twice would otherwise be gathered once per use; the distance counts the
        elements other groups gather in between. The pass's end releases it.
        """
        if self.live_numel > self.max_live_numel:
            self._release(state)  # over stage3_max_live_parameters: keep nothing extra
            return
        distance = trace.reuse_distance(state)
        if distance is not None and distance <= self.max_reuse_distance:
            return
        if (
            trace is self.forward_trace
            and torch.is_grad_enabled()
            and self._keeps_for_backward(state, trace.weight_ahead())
        ):
            return  # the forward is ending and its backward starts with this group
        self._release(state)

    def _release(self, state: GroupState) -> None:
        gather = state.sharded_gather
        if gather.releasable:
            # `param.data = t` while gathered would leave the parameter holding `t` after
            # the release, and every later gather would fill a buffer it no longer views.
            state.flat.drop_replaced()
        if gather.release_if_unused():
            self.live_numel -= gather.numel

    def _issue(self, state: GroupState, gather: GatherState) -> None:
        """Start gathering `state` (its place in the collective order checked first)."""
        if self.order is not None:
            # hpZ: which group the gather runs in is part of its place in the order.
            operation = "gather secondary" if gather.gathers_from_secondary else "gather"
            self.order.note(operation, state.order)
        self._count_in(gather)
        gather.to_inflight()

    def _count_in(self, gather: GatherState) -> None:
        self.live_numel += gather.numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _remember_external(self, module: nn.Module, state: GroupState) -> None:
        if state in self._module_groups.get(module, []):
            return
        external = self._external.setdefault(module, [])
        if state not in external:
            external.append(state)

    def _unwind_to(self, module: nn.Module) -> None:
        while self._scopes and self._scopes[-1].module is not module:
            scope = self._scopes.pop()
            self._close(scope)
            for state in scope.held:
                self._release(state)

    def _hold_for(self, scope: _Scope, state: GroupState) -> None:
        """`scope` (a forward's, gathered) reads `state` until it ends: hold and claim it,
        and make sure the scope saves through the saved-tensor hooks."""
        gather = state.sharded_gather
        gather.hold()
        gather.claim()
        scope.held.append(state)
        if not scope.saving and self.windows is not None:
            scope.saving = self.windows.push_if_possible()

    def _close(self, scope: _Scope) -> None:
        """`scope` ends: drop its holds and claims, and the saved-tensor hooks it installed."""
        for state in scope.held:
            state.sharded_gather.unhold()
            state.sharded_gather.unclaim()
        if scope.saving and self.windows is not None:
            self.windows.pop()
            scope.saving = False

    def _set_forward_pass(self, running: bool) -> None:
        for state in self.states:
            state.sharded_gather.set_forward_pass(running)
