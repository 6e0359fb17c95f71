"""Stage 3's public names: parameter status, gathering outside forward, full state dicts."""

from __future__ import annotations

from torch import nn

from zerodp.gathered import GatheredParameters
from zerodp.group import ParamStatus
from zerodp.managed import manager_of
from zerodp.params import zero_parameter
from zerodp.params.init import Init
from zerodp.state_dicts import full_state_dict, load_state_dict, save_state_dict

__all__ = [
    "GatheredParameters",
    "Init",
    "ParamStatus",
    "full_state_dict",
    "is_persistent",
    "load_state_dict",
    "param_status",
    "save_state_dict",
]


def param_status(param: nn.Parameter) -> ParamStatus:
    """NOT_AVAILABLE, INFLIGHT or AVAILABLE; parameters zerodp does not shard are AVAILABLE."""
    manager = manager_of(param)
    if manager is not None:
        manager.ensure_no_stale_backward()
        return manager.params.status(param)
    owner = zero_parameter.owner_of(param)  # built under zero.Init, no engine yet
    state = owner.group_of(param) if owner is not None else None
    return ParamStatus.AVAILABLE if state is None else state.status


def is_persistent(param: nn.Parameter) -> bool:
    """Whether `param` stays gathered all the time (every parameter at stages 0-2; at stage 3,
    those below stage3_param_persistence_threshold)."""
    manager = manager_of(param)
    if manager is None:
        return zero_parameter.owner_of(param) is None
    state = manager.groups.state_of(param)
    return state is None or state.persistent
