"""Access to one parameter's state, whatever the stage.

`safe_get_full_*` are collectives: every rank calls them for the same
parameter, in the same order, and gets the whole tensor. `safe_get_local_*`
need no communication: each rank gets its own part of the flattened
parameter (the part its optimizer owns: the whole parameter at stage 0, its
share of the shard at stages 1-3; possibly empty). Parameters zerodp does not
manage are answered locally.
"""

from __future__ import annotations

import torch
from torch import nn

from zerodp.full_state.param_managers import manager_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
]


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The full gradient of `param`, averaged over ranks (None if it has none)."""
    engine = manager_of(param)
    if engine is None:
        return None if param.grad is None else param.grad.detach().clone()
    engine.ensure_no_stale_backward()
    return engine.full_state.full_grad(param)


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor:
    """The full fp32 value of `param` (the master copy under mixed precision)."""
    engine = manager_of(param)
    if engine is None:
        return param.detach().float().clone()
    return engine.full_state.full_fp32_param(param)


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set `param` to the full `value` (every rank passes the same value)."""
    engine = manager_of(param)
    if engine is None:
        with torch.no_grad():
            param.copy_(value)
        return
    engine.full_state.set_full_fp32_param(param, value)


def safe_get_full_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor | None:
    """The full optimizer state `key` (e.g. "exp_avg") of `param`, or None before any step."""
    engine = manager_of(param)
    if engine is None:
        return None
    return engine.full_state.full_optimizer_state(param, key)


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's part of `param`'s gradient, flattened (see the module docstring)."""
    engine = manager_of(param)
    if engine is None:
        return None if param.grad is None else param.grad.detach().reshape(-1).clone()
    engine.ensure_no_stale_backward()
    return engine.full_state.local_grad(param)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of `param`'s fp32 value (the master copy), flattened."""
    engine = manager_of(param)
    if engine is None:
        return param.detach().float().reshape(-1).clone()
    return engine.full_state.local_fp32_param(param)


def safe_get_local_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor | None:
    """This rank's part of the optimizer state `key` of `param`, or None before any step."""
    engine = manager_of(param)
    if engine is None:
        return None
    return engine.full_state.local_optimizer_state(param, key)
