"""When stage 3 groups are gathered and released.

The coordinator decides for every sharded group (`GroupState.gather`) and is
told what happens by the module hooks (`zerodp.stage3.module_hooks`), the
parameters themselves (`ZeroParameter`) and the backward lifecycle:

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

It joins three parts, each with its own module: `GroupGatherer` (issuing,
waiting for, releasing and holding gathers, and what is live),
`ForwardScopes` (the forward scopes running now, what each holds and claims,
their saving windows) and `ModuleGroups` (which groups each module gathers).
What stays here is the passes: their beginning and end, the recorded order of
each kind of pass (`forward_trace`, `backward_trace`) and the rules for what a
pass keeps gathered (reuse within `stage3_max_reuse_distance`, the head of the
backward about to follow, kept while a backward can still come: [Note: kept
for the backward's head] in `zerodp.stage3.forward_graphs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from zerodp.backward import autograd_api
from zerodp.comm.faults.collective_order import CollectiveOrder
from zerodp.errors import ParamStateError
from zerodp.group_state import GroupIndex, GroupState, ParamStatus
from zerodp.stage3.forward_graphs import ForwardGraphs
from zerodp.stage3.forward_scopes import ForwardScopes
from zerodp.stage3.gatherer import GroupGatherer
from zerodp.stage3.module_groups import ModuleGroups
from zerodp.stage3.prefetch import ExecutionTrace
from zerodp.torch_internals import same_tensor_view


class LeafGradients(Protocol):
    """The reducer, as leaf modules need it (see [Note: leaf modules])."""

    def hold_back(self, states: frozenset[GroupState]) -> None: ...

    def settle(self, states: list[GroupState]) -> None: ...


def _numel_of(state: GroupState) -> int:
    return state.sharded_gather.numel


class ParamCoordinator:
    """Decides when the sharded groups of one engine are gathered and released."""

    def __init__(
        self,
        index: GroupIndex,
        gatherer: GroupGatherer,
        scopes: ForwardScopes,
        module_groups: ModuleGroups,
        *,
        order: CollectiveOrder | None,
        max_reuse_distance: int = 0,
        gradients: LeafGradients | None = None,
    ) -> None:
        self.index = index
        self.gatherer = gatherer
        self.scopes = scopes
        self.module_groups = module_groups
        self.order = order  # checks every pass's collectives, if set
        self.max_reuse_distance = max_reuse_distance
        self._gradients = gradients
        self.forward_trace: ExecutionTrace[GroupState] = ExecutionTrace(_numel_of)
        self.backward_trace: ExecutionTrace[GroupState] = ExecutionTrace(_numel_of)
        self._backward_head: set[GroupState] = set()  # groups the backward uses first
        # The forwards' graphs a backward may still run through; when the last is freed,
        # what was kept for a backward goes.
        self.graphs = ForwardGraphs(self.gatherer.release_kept)

    # -- forward -------------------------------------------------------------------

    def begin_forward(self) -> None:
        if self.order is not None:
            self.order.begin("forward")
        self.gatherer.release_unheld()  # what a forward kept for a backward that never came
        self.scopes.begin_pass()
        self.forward_trace.begin_pass()
        self._backward_head = self._first_backward_groups()

    def end_forward(self, graph: list[torch.autograd.graph.Node]) -> None:
        """Release what the forward gathered, except what its backward would prefetch first.

        `graph`: the nodes that produced the output's tensors that require grad; empty
        when no backward can come through the output. The groups a forward ends with (an
        output layer, an embedding tied to it) are the ones its backward starts with: when
        a backward can follow, groups within the backward's first
        `stage3_prefetch_bucket_size` elements stay gathered instead of being released and
        gathered straight back, until that backward, or until no backward can come (see
        [Note: kept for the backward's head]).
        """
        self.forward_trace.end_pass()
        # Until a backward has been recorded, expect it to run the forward in reverse, so
        # that the first backward prefetches like every later one.
        self.backward_trace.seed(self.forward_trace.recorded[::-1])
        for state in self.gatherer.states:
            gathered = state.sharded_gather.status is not ParamStatus.NOT_AVAILABLE
            if graph and gathered and self._keeps_for_backward(state, ahead=0):
                self.gatherer.keep_for_backward(state)
            else:
                self.gatherer.release(state)
        if graph:
            self.graphs.add(graph)
        self.scopes.end_pass()
        if self.order is not None:
            self.order.end()

    def fail_forward(self, error: BaseException) -> None:
        """The forward raised `error` on this rank: release what it gathered, and tell the
        other ranks, which wait for its part of the pass ([Note: failure notices])."""
        if self.order is not None:
            self.order.fail(error)
        self.abort()

    def _first_backward_groups(self) -> set[GroupState]:
        kept: set[GroupState] = set()
        budget = self.gatherer.prefetch_numel
        for state in self.backward_trace.recorded:
            if budget <= 0:
                break
            if state not in kept:
                kept.add(state)
                budget -= state.sharded_gather.numel
        return kept

    def pre_forward(self, module: nn.Module) -> None:
        scope = self.scopes.enter(module, in_backward=autograd_api.in_backward())
        trace = self.backward_trace if scope.in_backward else self.forward_trace
        for state in self.module_groups.gathered_for(module):
            self.gatherer.gather(state, trace)
            if not scope.in_backward:
                self.scopes.claim(scope, state)

    def post_forward(self, module: nn.Module) -> None:
        for abandoned in self.scopes.unwind_to(module):  # a forward raised part-way
            for state in abandoned.held:
                self.gatherer.release(state)
        scope = self.scopes.leave()
        if scope is None:
            return
        for state in scope.held:
            self._release_unless_reused(state, self.forward_trace)

    # -- backward ------------------------------------------------------------------

    def begin_backward(self, reduces_across: bool = False) -> None:
        """A backward starts; `reduces_across`: it ends an accumulation window, so its
        reductions go on across shard groups (its collective order differs)."""
        if self.order is not None:
            self.order.begin("backward", "reducing across" if reduces_across else "")
        self.backward_trace.begin_pass()
        # What the forwards kept for a backward is this one's now: its end releases it.
        self.gatherer.forget_kept()
        self.graphs.backward_started()

    def pre_backward(self, module: nn.Module) -> None:
        for state in self.module_groups.gathered_for(module):
            self.gatherer.gather(state, self.backward_trace)

    def post_backward(self, module: nn.Module) -> None:
        for state in self.module_groups.gathered_for(module):
            self._release_unless_reused(state, self.backward_trace)

    def end_leaf_backward(self, leaf: nn.Module) -> None:
        """The backward of leaf `leaf` is done: its groups' gradients are in, they can go."""
        if self._gradients is not None:
            self._gradients.settle(self.module_groups.leaves.subtree_groups(leaf))
        self.post_backward(leaf)

    def on_grads_complete(self, state: GroupState) -> None:
        """Every parameter of `state` has its gradient for this task: it can go.

        Never a leaf's group (the reducer holds those back): that is released when the
        leaf's backward is done, the same point on every rank (a rank may complete a
        group early, another never).
        """
        if state.gather is not None:
            self.gatherer.release(state)

    def end_backward(self) -> None:
        self.backward_trace.end_pass()
        self.gatherer.release_unheld()

    def end_backward_order(self) -> None:
        """The task's last collective (the reducer's, at its end) is issued: the pass is over."""
        if self.order is not None:
            self.order.end()

    def abort(self) -> None:
        """A forward or backward died part-way: release everything, forget all scopes."""
        self.scopes.close_all()
        self.gatherer.drop_holds()
        self.scopes.end_pass()
        self.gatherer.release_unheld()
        if self.order is not None:
            self.order.abandon()

    # -- gathering on use (the `ParamOwner` of every sharded parameter) -------------------

    def before_use(self, param: nn.Parameter, func: Callable[..., Any]) -> None:
        """A torch operation is about to read `param` (called by ZeroParameter)."""
        state = self.index.state_of(param)
        if state is None or state.gather is None:
            return
        scope = self.scopes.innermost
        if state.gather.status is ParamStatus.AVAILABLE:
            # Gathered but guarded: a forward is running and no scope claims it (a group
            # kept for reuse, prefetched, or held by GatheredParameters). The running scope
            # claims it; nothing is gathered, so nothing changes the next forward's plan.
            if not state.gather.claims and scope is not None and not scope.in_backward:
                self.scopes.claim(scope, state)
            return
        if scope is not None:
            self.gatherer.gather(state)
            if not scope.in_backward:
                self.scopes.claim(scope, state)
                self.module_groups.remember_use(scope.module, state)
            return
        if autograd_api.in_backward():
            self.gatherer.gather(state)
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

    def group_of(self, param: nn.Parameter) -> GroupState | None:
        state = self.index.state_of(param)
        return state if state is not None and state.gather is not None else None

    def hold(self, state: GroupState) -> None:
        self.gatherer.hold(state)

    def unhold(self, state: GroupState) -> None:
        self.gatherer.unhold(state)

    # -- what a pass keeps gathered ----------------------------------------------------

    def _keeps_for_backward(self, state: GroupState, ahead: int) -> bool:
        """Whether the backward about to follow starts with `state` (so it stays gathered).

        The one rule for "the backward's head": `state` is among the groups the
        recorded backward uses first, what the forward still has to run (`ahead`
        elements) fits in the prefetch budget, and the live cap leaves room.
        """
        return (
            state in self._backward_head
            and not self.gatherer.over_live_cap
            and ahead <= self.gatherer.prefetch_numel
        )

    def _release_unless_reused(self, state: GroupState, trace: ExecutionTrace[GroupState]) -> None:
        """Keep a group the rest of this pass uses again within `max_reuse_distance`.

        Tied weights (an embedding reused as the output layer) and modules called
        twice would otherwise be gathered once per use; the distance counts the
        elements other groups gather in between. The pass's end releases it.
        """
        if self.gatherer.over_live_cap:
            self.gatherer.release(state)  # over stage3_max_live_parameters: keep nothing extra
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
        self.gatherer.release(state)
