"""Full (unsharded) access to one parameter's state, whatever the stage.

Each function is a collective: every rank calls it for the same parameter,
in the same order. Parameters zerodp does not manage are answered locally.
"""

from __future__ import annotations

import torch
from torch import nn

from zerodp.engine import engine_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
]


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The full gradient of `param`, averaged over ranks (None if it has none)."""
    engine = engine_of(param)
    if engine is None:
        return None if param.grad is None else param.grad.detach().clone()
    engine.ensure_no_stale_backward()
    return engine.full_state.full_grad(param)


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor:
    """The full fp32 value of `param` (the master copy under mixed precision)."""
    engine = engine_of(param)
    if engine is None:
        return param.detach().float().clone()
    return engine.full_state.full_fp32_param(param)


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set `param` to the full `value` (every rank passes the same value)."""
    engine = engine_of(param)
    if engine is None:
        with torch.no_grad():
            param.copy_(value)
        return
    engine.full_state.set_full_fp32_param(param, value)


def safe_get_full_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor | None:
    """The full optimizer state `key` (e.g. "exp_avg") of `param`, or None before any step."""
    engine = engine_of(param)
    if engine is None:
        return None
    return engine.full_state.full_optimizer_state(param, key)
