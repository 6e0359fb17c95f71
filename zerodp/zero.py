"""Stage 3's public names: parameter status, gathering outside forward, full state dicts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerodp import registry
from zerodp.params import zero_parameter
from zerodp.params.gathered import GatheredParameters
from zerodp.params.init import Init
from zerodp.params.status import ParamStatus

__all__ = [
    "GatheredParameters",
    "Init",
    "ParamStatus",
    "full_state_dict",
    "is_persistent",
    "param_status",
]


def param_status(param: nn.Parameter) -> ParamStatus:
    """NOT_AVAILABLE, INFLIGHT or AVAILABLE; parameters zerodp does not shard are AVAILABLE."""
    engine = registry.engine_of(param)
    if engine is not None:
        return engine.param_status(param)
    owner = zero_parameter.owner_of(param)  # built under zero.Init, no engine yet
    group = owner.group_of(param) if owner is not None else None
    return ParamStatus.AVAILABLE if group is None else group.status


def is_persistent(param: nn.Parameter) -> bool:
    """Whether stage 3 keeps `param` gathered (it is below stage3_param_persistence_threshold)."""
    engine = registry.engine_of(param)
    if engine is None:
        return zero_parameter.owner_of(param) is None
    if engine.stage3 is None:
        return True
    group = engine.stage3.group_of(param)
    return group is None or group.persistent


def full_state_dict(
    module: nn.Module, rank0_only: bool = False, device: str | torch.device = "cpu"
) -> dict[str, Any]:
    """The module's full state dict, gathered group by group (a collective at stage 3).

    With `rank0_only`, ranks other than 0 gather (they must take part) but
    return an empty dict, so only rank 0 holds the full copy in memory.
    """
    engine = next(
        (e for e in (registry.engine_of(p) for p in module.parameters()) if e is not None), None
    )
    keep = not rank0_only or engine is None or engine.global_rank == 0
    values: dict[int, torch.Tensor] = {}
    if engine is not None and engine.stage3 is not None:
        for group in engine.stage3.sharded:
            with GatheredParameters(group.flat.params):
                if keep:
                    for param in group.flat.params:
                        values[id(param)] = param.detach().to(device).clone()
    if not keep:
        return {}
    state: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            gathered = values.get(id(value))
            state[key] = gathered if gathered is not None else value.detach().to(device).clone()
        else:
            state[key] = value
    return state
