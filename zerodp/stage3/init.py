"""`zerodp.zero.Init`: build a model already sharded, one module at a time.

Under `with zerodp.zero.Init(config=...):` every module is sharded as soon as
it is complete: when it is registered into its parent (PyTorch's global
module-registration hook), or, for the outermost modules, when the block
ends. Each rank builds a module whole, then keeps only its shard (of rank 0's
values, broadcast, so that ranks seeded differently still agree), so the peak
is one module, not the model.

A parent's constructor often initialises its children's weights after they
were registered (`self.apply(init_weights)`, tying weights). Those writes go
through `ZeroParameter`: the parameter is gathered, the operation runs on the
whole tensor (consuming the random generator exactly as an unsharded build
would, so the result is identical to building the model normally with the
same seed), rank 0's result is broadcast and each rank keeps its shard. An
access through `.data` hands out an alias the hooks cannot follow, so such a
parameter stays gathered until the block ends (use `nn.init` functions or
in-place operations on the parameter to keep the peak at one module).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp.comm import Comm, default_device, ensure_process_group
from zerodp.comm.subgroups import group_comms
from zerodp.config import load_config
from zerodp.errors import ParamStateError
from zerodp.group_state import GatherState, GroupIndex, GroupState, ParamStatus
from zerodp.partition import FlatGroup
from zerodp.stage3 import zero_parameter
from zerodp.stage3.zero_parameter import AfterUse
from zerodp.torch_internals import PlainTensorOps, direct_parameter_items, storage_key


class Init:
    """Shard parameters as modules are built; see the module docstring."""

    def __init__(
        self,
        config: Any = None,
        enabled: bool = True,
        persistence_threshold: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.config = config
        self.persistence_threshold = persistence_threshold
        self._handles: list[RemovableHandle] = []
        self._owner: InitOwner | None = None
        self._registered: dict[nn.Module, None] = {}  # modules that registered a parameter
        self._module_of: dict[GroupState, nn.Module] = {}  # the module each group came from

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        ensure_process_group()
        comm = Comm()
        shard_comm = comm
        if self.config is not None:
            zero = load_config(self.config, world_size=comm.world_size).zero_optimization
            if self.persistence_threshold is None:
                self.persistence_threshold = zero.stage3_param_persistence_threshold
            # Shards laid out in the engine's shard groups (see [Note: shard groups]).
            shard_comm = group_comms(comm, shard_size=zero.mics_shard_size).shard
        if self.persistence_threshold is None:
            self.persistence_threshold = 0
        self._owner = InitOwner(comm, default_device(), shard_comm)
        self._owner.on_unshard = self._reshard_later
        registration = torch.nn.modules.module
        self._handles = [
            registration.register_module_parameter_registration_hook(self._on_parameter),
            registration.register_module_module_registration_hook(self._on_submodule),
        ]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if exc_type is None and self._owner is not None:
            for module in list(self._registered):
                self._shard_module(module)
        self._registered.clear()
        self._module_of.clear()

    # -- registration hooks --------------------------------------------------------------

    def _on_parameter(self, module: nn.Module, name: str, param: Any) -> None:
        if param is not None:
            self._registered[module] = None

    def _on_submodule(self, parent: nn.Module, name: str, child: Any) -> None:
        if isinstance(child, nn.Module):
            for module in child.modules():
                if module in self._registered:
                    self._shard_module(module)

    def _reshard_later(self, state: GroupState) -> None:
        """A group was made whole again (`.data` of a new shape): shard its module at the end."""
        module = self._module_of.pop(state, None)
        if module is not None:
            self._registered[module] = None

    def _shard_module(self, module: nn.Module) -> None:
        owner = self._owner
        if owner is None:
            return
        large: dict[tuple[torch.dtype, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, param in direct_parameter_items(module):
            if zero_parameter.owner_of(param) is not None:
                continue
            if param.numel() < max(1, self.persistence_threshold or 0):
                continue
            large.setdefault((param.dtype, param.requires_grad), []).append((name, param))
        for members in large.values():
            state = owner.shard([p for _, p in members], [n for n, _ in members])
            self._module_of[state] = module
        self._registered.pop(module, None)


class InitOwner:
    """Owns the groups sharded by `Init` until `zerodp.initialize` adopts them.

    `comm` (every rank) publishes rank 0's values; `shard_comm` is the group the shards
    are spread over (every rank, unless the config has shard groups).
    """

    def __init__(self, comm: Comm, device: torch.device, shard_comm: Comm | None = None) -> None:
        self.comm = comm
        self.shard_comm = comm if shard_comm is None else shard_comm
        self.device = device
        self.index = GroupIndex()
        self.on_unshard: Callable[[GroupState], None] = lambda state: None

    def shard(self, params: list[nn.Parameter], names: list[str]) -> GroupState:
        flat = FlatGroup(
            params=params,
            names=names,
            world_size=self.shard_comm.world_size,
            rank=self.shard_comm.rank,
            device=self.device,
            param_group_index=-1,
            persistent=False,
        )
        self.comm.broadcast(flat.full, src=0)
        flat.take_shard_from_full()
        # Groups are numbered in creation order, the same on every rank.
        gather = GatherState(flat, self.shard_comm)
        state = GroupState(flat, order=len(self.index), comm=self.shard_comm, gather=gather)
        self.index.add(state)
        for param in params:
            zero_parameter.adopt(param, self)
        return state

    # -- the ParamOwner protocol -----------------------------------------------------------

    def group_of(self, param: nn.Parameter) -> GroupState | None:
        return self.index.state_of(param)

    def hold(self, state: GroupState) -> None:
        gather = state.sharded_gather
        gather.to_available()
        gather.hold()

    def unhold(self, state: GroupState) -> None:
        gather = state.sharded_gather
        gather.unhold()
        gather.release_if_unused()

    def before_use(self, param: nn.Parameter, func: Callable[..., Any]) -> AfterUse | None:
        state = self.index.state_of(param)
        if state is None:
            return None
        gather = state.sharded_gather

        def track(result: Any) -> Any:
            return _track_aliases(result, param, storage_key(state.flat.full))

        if zero_parameter.is_data_property(func) or gather.holds > 0:
            return track  # `.data` reads nothing; a held group is published by its holder
        if gather.status is ParamStatus.AVAILABLE:
            return track
        self.hold(state)
        writes = zero_parameter.is_in_place(func)

        def after(result: Any) -> Any:
            if writes:
                self._publish(state)
            self.unhold(state)
            return track(result)

        return after

    def assign_data(self, param: nn.Parameter, value: Any) -> None:
        """`param.data = value` while building: the value is written into the group.

        A value of the parameter's shape is copied in (rank 0's wins, as for any
        write); one of another shape (Hugging Face pads biases that way) makes the
        group whole again, and it is sharded afresh when the block ends.
        """
        state = self.index.state_of(param)
        if state is None or not isinstance(value, torch.Tensor):
            raise ParamStateError(f"cannot assign {type(value).__name__} to `.data`")
        if isinstance(value, zero_parameter.ZeroView) and value.zerodp_source is not param:
            raise ParamStateError(
                "sharing one parameter's `.data` with another is not supported under "
                "zerodp.zero.Init; tie parameters by assigning the Parameter itself "
                "(`module.weight = other.weight`)"
            )
        if tuple(value.shape) == tuple(param.shape):
            self.hold(state)
            start, end = state.flat.slot_of(state.flat.position_of(param))
            with torch.no_grad(), PlainTensorOps():
                state.flat.full[start:end].copy_(value.reshape(-1))
            self._publish(state)
            self.unhold(state)
            return
        self._unshard(state)
        param.data = value

    def _unshard(self, state: GroupState) -> None:
        """Give the group's parameters their own whole tensors again; shard them later."""
        self.hold(state)
        flat = state.flat
        with torch.no_grad(), PlainTensorOps():
            for param, slot in zip(flat.params, flat.layout.slots, strict=True):
                zero_parameter.release(param)
                param.data = flat.full[slot.offset : slot.end].clone().view(slot.shape)
        self.unhold(state)
        self.index.remove(state)
        self.on_unshard(state)

    def _publish(self, state: GroupState) -> None:
        """Rank 0's values win (as at construction); every rank keeps its shard."""
        self.comm.broadcast(state.flat.full, src=0)
        state.flat.take_shard_from_full()


def _track_aliases(result: Any, source: nn.Parameter, key: int) -> Any:
    """Results that share `source`'s storage become ZeroViews (see `ZeroView`)."""
    if isinstance(result, torch.Tensor):
        if storage_key(result) == key:
            return zero_parameter.as_view_of(result, source)
        return result
    if type(result) in (list, tuple) and any(
        isinstance(t, torch.Tensor) and storage_key(t) == key for t in result
    ):
        return type(result)(_track_aliases(t, source, key) for t in result)
    return result


def init_groups(module: nn.Module) -> list[GroupState]:
    """The groups `Init` sharded for `module`'s parameters, in parameter order."""
    found: list[GroupState] = []
    for param in module.parameters():
        owner = zero_parameter.owner_of(param)
        if isinstance(owner, InitOwner):
            group = owner.group_of(param)
            if group is not None and all(group is not g for g in found):
                found.append(group)
    return found


def adopt_init_groups(
    module: nn.Module,
    trainable_groups: dict[int, int],
    keep_sharded: bool,
    persistence_threshold: int,
    num_shards: int,
) -> list[FlatGroup]:
    """Hand `Init`'s groups over to an engine being built for `module`.

    A group is kept sharded as it is when the engine shards parameters, all of
    its parameters are still in the module (tying may have replaced some), they
    share one optimizer param group and whether they require grad, none is
    below the persistence threshold, and it has the engine's `num_shards` (the
    shard group's size: `Init` without the engine's config shards over all
    ranks). Any other group is gathered and its parameters made plain, so
    that the engine lays them out afresh (copying their values).
    """
    present = {id(p) for p in module.parameters()}
    kept: list[FlatGroup] = []
    for state in init_groups(module):
        params = state.params
        same_group = len({trainable_groups.get(id(p), -1) for p in params}) == 1
        # Model code may freeze part of a module after it was sharded (Whisper's positions).
        same_grad = len({p.requires_grad for p in params}) == 1
        keep = (
            keep_sharded
            and same_group
            and same_grad
            and all(id(p) in present for p in params)
            and all(p.numel() >= persistence_threshold for p in params)
            and state.flat.layout.world_size == num_shards
        )
        if not keep:
            state.sharded_gather.to_available()
        for param in params:
            zero_parameter.release(param)
        if keep:
            kept.append(state.flat)
    return kept
