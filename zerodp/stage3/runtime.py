"""The parameter side of an engine: stage 3's gather-on-use runtime, or its null object.

Both classes have one surface, so the engine, the optimizer and the public
`zerodp.zero` functions never ask which stage they are at:

- `ResidentParams` (stages 0-2): every parameter is whole all the time;
  after a step the updated shards are all-gathered (stages 1, 2);
- `Stage3Runtime`: sharded groups, their coordinator and the hooks that drive
  it; after a step only what is gathered then (persistent groups, and groups
  a `GatheredParameters` block holds) is refreshed.
"""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.backward.reducer import GradientReducer
from zerodp.comm import Comm
from zerodp.comm.faults.collective_order import CollectiveOrder
from zerodp.comm.subgroups import GroupComms
from zerodp.group_state import GroupIndex, GroupState, ParamStatus
from zerodp.stage3 import zero_parameter
from zerodp.stage3.coordinator import ParamCoordinator
from zerodp.stage3.divergence import DivergenceExplainer
from zerodp.stage3.forward_scopes import ForwardScopes
from zerodp.stage3.gatherer import GroupGatherer
from zerodp.stage3.module_groups import ModuleGroups
from zerodp.stage3.module_hooks import Stage3ModuleHooks
from zerodp.stage3.saved_tensors import SavedTensorGatherer


def all_gather_full(states: list[GroupState]) -> None:
    """Make each group's full buffer match every rank's (updated) shard, all in flight at once,
    each in the group it is sharded over (`GroupState.comm`)."""
    handles = [s.comm.all_gather(s.flat.full, s.flat.shard, async_op=True) for s in states]
    for handle in handles:
        handle.wait()


def _own_groups(
    index: GroupIndex, module_params: dict[nn.Module, list[nn.Parameter]]
) -> dict[nn.Module, list[GroupState]]:
    """Each module's sharded groups: those its direct parameters are in, in first-use order."""
    own: dict[nn.Module, list[GroupState]] = {}
    for module, direct in module_params.items():
        states: list[GroupState] = []
        for param in direct:
            state = index.state_of(param)
            if state is not None and state.gather is not None and state not in states:
                states.append(state)
        if states:
            own[module] = states
    return own


class ResidentParams:
    """Stages 0-2: parameters stay whole; the stage 3 surface, doing only what applies."""

    def __init__(self, index: GroupIndex, *, publish_after_step: bool) -> None:
        self.index = index
        self._publishes = publish_after_step  # stage 0 steps whole groups: nothing to gather

    def status(self, param: nn.Parameter) -> ParamStatus:
        return ParamStatus.AVAILABLE

    @property
    def sharded_states(self) -> list[GroupState]:
        return []

    @property
    def module_hooks(self) -> list[RemovableHandle]:
        """No module needs a hook to gather at stages 0-2."""
        return []

    def release_all(self) -> None:
        """Nothing is gathered on demand at stages 0-2."""

    def on_grads_complete(self, state: GroupState) -> None:
        """Nothing to release once a group's gradients are in."""

    def after_backward(self) -> None:
        """Nothing is checked at stages 0-2 (reductions are in one fixed order)."""

    def publish_after_step(self) -> None:
        if self._publishes:
            all_gather_full(self.index.trainable)

    def teardown(self) -> None:
        """Parameters are plain and whole already."""


def collective_order_for(
    root: nn.Module,
    index: GroupIndex,
    world: Comm,
    *,
    check: bool,
    timeout_s: float | None,
) -> CollectiveOrder | None:
    """Stage 3's collective order check for `root`'s groups, or None when there is nothing
    to check (`stage3_check_order` off, or one rank).

    Built before the parts that issue the collectives it checks (the reducer, the stage 3
    runtime), which take it at construction. Every rank builds it in the same order.
    """
    if not check or world.world_size <= 1:
        return None
    explainer = DivergenceExplainer(root, index)
    on_cpu = all(s.flat.device.type == "cpu" for s in index)
    # Every rank takes part in a pass; the subgroups' waits are watched through it.
    return CollectiveOrder(
        world,
        describe=explainer.describe,
        advise=explainer.advise,
        timeout_s=timeout_s,
        watch_waits=on_cpu,
    )


class Stage3Runtime:
    """Sharded groups gathered while in use: coordinator, module hooks, saved-tensor hooks.

    Its parts are built in dependency order, each complete when built: the gatherer (with
    `order`, the collective order check from `collective_order_for`), the saved-tensor
    hooks on the gatherer, the forward scopes on those hooks, and the coordinator on all
    of them.
    """

    def __init__(
        self,
        root: nn.Module,
        index: GroupIndex,
        module_params: dict[nn.Module, list[nn.Parameter]],
        comms: GroupComms,
        lifecycle: BackwardLifecycle,
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_distance: int,
        order: CollectiveOrder | None,
        reducer: GradientReducer | None = None,
    ) -> None:
        self.index = index
        self.order = order
        self.gatherer = GroupGatherer(
            index.sharded,
            order=order,
            prefetch_numel=prefetch_numel,
            max_live_numel=max_live_numel,
        )
        self.saved_tensors = SavedTensorGatherer(self.gatherer, lifecycle)
        self.module_groups = ModuleGroups(
            root,
            _own_groups(index, module_params),
            on_leaves_change=reducer.hold_back if reducer is not None else None,
        )
        self.coordinator = ParamCoordinator(
            index,
            self.gatherer,
            ForwardScopes(index.sharded, self.saved_tensors),
            self.module_groups,
            order=order,
            max_reuse_distance=max_reuse_distance,
            gradients=reducer,
        )
        # Kept apart: `gathered_for_generation()` takes them out for a while (see posttrain).
        self.module_hooks: list[RemovableHandle] = Stage3ModuleHooks(
            root, self.coordinator, self.module_groups, lifecycle
        ).install()
        self._handles: list[RemovableHandle] = [
            lifecycle.on_prologue(
                lambda task: self.coordinator.begin_backward(
                    reducer is not None and reducer.window.task_reduces()
                )
            ),
            lifecycle.on_epilogue(lambda task: self.coordinator.end_backward()),
            lifecycle.on_abort(lambda task: self.coordinator.abort()),
        ]
        for state in self.sharded_states:
            for param in state.params:
                zero_parameter.adopt(param, self.coordinator)
            # Guarded while released (and unclaimed in a forward): `GatherState.guard_with`.
            state.sharded_gather.guard_with(nn.Parameter, zero_parameter.ZeroParameter)

    @property
    def sharded_states(self) -> list[GroupState]:
        return self.gatherer.states

    def status(self, param: nn.Parameter) -> ParamStatus:
        state = self.index.state_of(param)
        return ParamStatus.AVAILABLE if state is None else state.status

    def release_all(self) -> None:
        """Release every group nobody holds (what a forward kept for its backward, too)."""
        self.gatherer.release_unheld()

    def on_grads_complete(self, state: GroupState) -> None:
        self.coordinator.on_grads_complete(state)

    def after_backward(self) -> None:
        """A task's epilogue is over, its reductions too: its collective order is complete."""
        self.coordinator.end_backward_order()

    def publish_after_step(self) -> None:
        """Release what may go, then refresh every trainable group still gathered.

        After a step only persistent groups (and groups someone holds) are gathered.
        Every secondary shard is stale now (see [Note: hpZ secondary shard]).
        """
        for state in self.sharded_states:
            state.sharded_gather.shard_changed()
        self.release_all()
        resident = []
        for state in self.index.trainable:
            if state.gather is not None and state.gather.status is ParamStatus.INFLIGHT:
                state.gather.to_available()
            if state.status is ParamStatus.AVAILABLE:
                resident.append(state)
        all_gather_full(resident)

    def teardown(self) -> None:
        """Gather everything and leave plain, whole parameters behind.

        Not after a `DivergenceError`: no collective can be trusted then, so it is raised
        again and the parameters stay sharded.
        """
        if self.order is not None:
            self.order.raise_if_failed()
        for handle in self._handles + self.module_hooks:
            handle.remove()
        self._handles, self.module_hooks = [], []
        self.coordinator.graphs.close()
        self.coordinator.abort()
        self.gatherer.gather_all()
        for state in self.sharded_states:
            if state.gather is not None:
                state.gather.drop_holds()
                state.gather.unguard(nn.Parameter)
            for param in state.params:
                zero_parameter.release(param)
