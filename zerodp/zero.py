"""Stage 3's public names: parameter status, gathering outside forward, full state dicts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerodp.engine import ZeroEngine, engine_of
from zerodp.gathered import GatheredParameters
from zerodp.group import ParamStatus
from zerodp.params import zero_parameter
from zerodp.params.init import Init

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
    engine = engine_of(param)
    if engine is not None:
        return engine.param_status(param)
    owner = zero_parameter.owner_of(param)  # built under zero.Init, no engine yet
    state = owner.group_of(param) if owner is not None else None
    return ParamStatus.AVAILABLE if state is None else state.status


def is_persistent(param: nn.Parameter) -> bool:
    """Whether `param` stays gathered all the time (every parameter at stages 0-2; at stage 3,
    those below stage3_param_persistence_threshold)."""
    engine = engine_of(param)
    if engine is None:
        return zero_parameter.owner_of(param) is None
    state = engine.groups.state_of(param)
    return state is None or state.persistent


def _engine_of_module(module: nn.Module) -> ZeroEngine | None:
    return next((e for e in map(engine_of, module.parameters()) if e is not None), None)


def full_state_dict(
    module: nn.Module, rank0_only: bool = False, device: str | torch.device = "cpu"
) -> dict[str, Any]:
    """The module's full state dict, gathered group by group (a collective at stage 3).

    With `rank0_only`, ranks other than 0 gather (they must take part) but
    return an empty dict, so only rank 0 holds the full copy in memory.
    """
    engine = _engine_of_module(module)
    keep = not rank0_only or engine is None or engine.global_rank == 0
    values: dict[int, torch.Tensor] = {}
    if engine is not None:
        for state in engine.params.sharded_states:
            with GatheredParameters(state.params):
                if keep:
                    for param in state.params:
                        values[id(param)] = param.detach().to(device).clone()
    if not keep:
        return {}
    result: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            gathered = values.get(id(value))
            result[key] = gathered if gathered is not None else value.detach().to(device).clone()
        else:
            result[key] = value
    return result
