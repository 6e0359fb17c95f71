"""`GatheredParameters`: whole parameters outside forward, optionally modified by one rank."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from types import TracebackType

import torch
from torch import nn

from zerodp.comm import Comm, broadcast_tensors, ensure_process_group
from zerodp.comm.agreement import agreement
from zerodp.comm.faults.uneven_inputs import Activity
from zerodp.errors import ParamStateError
from zerodp.full_state.param_managers import manager_of
from zerodp.group_state import GroupState
from zerodp.stage3 import zero_parameter


class GatheredParameters:
    """Gather `params` on entry; on exit keep what `modifier_rank` wrote (if given) and re-shard.

    Every rank must enter the block with the same parameters: gathering and
    the final broadcast are collectives. Inside, the parameters are whole and
    may be read; with `modifier_rank=r`, rank r may also write them in place
    (`param.copy_(...)`, `nn.init.*`), and on exit its values are broadcast
    and every rank keeps its shard of them (and the optimizer's copy follows).
    Without a modifier rank, writes to stage 3 parameters are discarded on
    exit. Parameters that are not sharded (stages 0-2, or not managed by
    zerodp) need no gathering; a modifier rank's values are still broadcast to
    all ranks.
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.params: list[nn.Parameter] = (
            [params] if isinstance(params, nn.Parameter) else list(params)
        )
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._held: list[tuple[zero_parameter.ParamOwner, GroupState]] = []
        self._activity: AbstractContextManager[None] | None = None

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        # Its collectives are an activity the ranks agree on ([Note: agreeing before a
        # collective]): a block entered on some ranks only is an UnevenInputsError at once.
        self._activity = agreement().doing(Activity.GATHERING)
        self._activity.__enter__()
        for owner, state in self._sharded_groups():
            owner.hold(state)
            self._held.append((owner, state))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._broadcast_from_modifier(int(self.modifier_rank))
        finally:
            try:
                for owner, state in reversed(self._held):
                    owner.unhold(state)
            finally:
                self._held = []
                if self._activity is not None:
                    self._activity.__exit__(None, None, None)
                    self._activity = None

    def _sharded_groups(self) -> list[tuple[zero_parameter.ParamOwner, GroupState]]:
        """(owner, group) pairs in the owner's fixed order, so that every rank gathers alike."""
        found: list[tuple[zero_parameter.ParamOwner, GroupState]] = []
        for param in self.params:
            owner = zero_parameter.owner_of(param)
            if owner is None:
                continue
            state = owner.group_of(param)
            if state is not None and all(state is not s for _, s in found):
                found.append((owner, state))
        found.sort(key=lambda pair: pair[1].order)
        return found

    def _broadcast_from_modifier(self, src: int) -> None:
        states: list[GroupState] = []
        loose: list[torch.Tensor] = []
        for param in self.params:
            state = _state_of(param)
            if state is None:
                loose.append(param.data)
            elif all(state is not s for s in states):
                states.append(state)
        states.sort(key=lambda s: s.order)
        comm = _comm_for(self.params)
        if states:
            comm.raise_if_any_failed(_take_replaced_data(states, keep=comm.rank == src))
        broadcast_tensors(comm, [s.flat.full for s in states] + loose, src=src)
        for state in states:
            state.flat.take_shard_from_full()
            if state.gather is not None:
                state.gather.shard_changed()  # see [Note: hpZ secondary shard]
            if state.optim is not None:
                state.optim.refresh_from_model()


def _take_replaced_data(states: list[GroupState], keep: bool) -> ParamStateError | None:
    """`param.data = t` inside the block: the modifier rank's `t` is kept (broadcast like
    any write), another rank's dropped; what cannot be kept is an error, which the caller
    makes every rank's before anything is broadcast."""
    try:
        for state in states:
            if keep:
                state.flat.adopt_replaced()
            else:
                state.flat.drop_replaced()
    except ParamStateError as error:
        return error
    return None


def _state_of(param: nn.Parameter) -> GroupState | None:
    owner = zero_parameter.owner_of(param)
    if owner is not None:
        return owner.group_of(param)
    manager = manager_of(param)
    return None if manager is None else manager.groups.state_of(param)


def _comm_for(params: list[nn.Parameter]) -> Comm:
    for param in params:
        manager = manager_of(param)
        if manager is not None:
            return manager.comm
    ensure_process_group()
    return Comm()
