"""Bytes of model state held by this rank: parameters, gradients, optimizer state.

Counted by storage, so views (parameters inside flat buffers, shards inside
full buffers, `.grad` views at stage 0) are counted once. Under ZeRO's
accounting fp32 master weights belong to the optimizer state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from zerodp.engine import ZeroEngine


@dataclass(frozen=True)
class ModelStateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


class _StorageCounter:
    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()

    def count(self, tensors: Iterable[Any]) -> int:
        total = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            key = (storage.data_ptr(), nbytes)
            if nbytes == 0 or key in self._seen:
                continue
            self._seen.add(key)
            total += nbytes
        return total


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[Any]:
    return [value for state in optimizer.state.values() for value in state.values()]


def engine_model_state_bytes(engine: ZeroEngine) -> ModelStateBytes:
    counter = _StorageCounter()
    groups = engine.layout.groups
    managed = {id(p) for g in groups for p in g.params}
    param_tensors: list[Any] = [g.full for g in groups] + [g.shard for g in groups]
    param_tensors += [p for p in engine.module.parameters() if id(p) not in managed]
    params = counter.count(param_tensors)
    grad_tensors: list[Any] = [g.storage for g in engine.reducer.groups]
    grad_tensors += [p.grad for p in engine.module.parameters() if p.grad is not None]
    grads = counter.count(grad_tensors)
    optimizer = counter.count(_state_tensors(engine.optimizer) + engine.optimizer_extra_state())
    return ModelStateBytes(params=params, grads=grads, optimizer=optimizer)


def plain_model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> ModelStateBytes:
    """The same accounting for a model trained without zerodp (DDP and the other engines)."""
    counter = _StorageCounter()
    params = counter.count(model.parameters())
    grads = counter.count(p.grad for p in model.parameters() if p.grad is not None)
    state = counter.count(_state_tensors(optimizer)) if optimizer is not None else 0
    return ModelStateBytes(params=params, grads=grads, optimizer=state)


def ideal_model_state_bytes(
    num_params: int, stage: int, world_size: int, dtype_bytes: int = 4, mixed: bool = False
) -> int:
    """The ZeRO paper's per-rank bytes for Adam: 16 per parameter replicated, shards per stage.

    fp32: parameters 4, gradients 4, Adam moments 8. Mixed precision: parameters 2,
    gradients 2, fp32 master weights and moments 12.
    """
    if mixed:
        p_bytes, g_bytes, o_bytes = 2, 2, 12
    else:
        p_bytes, g_bytes, o_bytes = dtype_bytes, dtype_bytes, 2 * dtype_bytes
    n = world_size
    per_param = {
        0: p_bytes + g_bytes + o_bytes,
        1: p_bytes + g_bytes + o_bytes / n,
        2: p_bytes + (g_bytes + o_bytes) / n,
        3: (p_bytes + g_bytes + o_bytes) / n,
    }[stage]
    return round(per_param * num_params)
