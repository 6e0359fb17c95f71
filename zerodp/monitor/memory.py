"""Bytes of model state held by this rank: parameters, gradients, optimizer state.

Counted by storage, so views (parameters inside flat buffers, shards inside
full buffers, `.grad` views at stage 0) are counted once. Under ZeRO's
accounting fp32 master weights belong to the optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes per category on the device; `host_*` the same on the host (offload)."""

    params: int
    grads: int
    optimizer: int
    host_params: int = 0
    host_grads: int = 0
    host_optimizer: int = 0

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def host_total(self) -> int:
        return self.host_params + self.host_grads + self.host_optimizer

    @property
    def total(self) -> int:
        return self.device_total + self.host_total


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


@dataclass(frozen=True)
class ModelStateTensors:
    """The tensors of model state one rank holds, by category and side (views may repeat)."""

    params: list[Any]
    grads: list[Any]
    optimizer: list[Any]
    host_params: list[Any] = field(default_factory=list)
    host_grads: list[Any] = field(default_factory=list)
    host_optimizer: list[Any] = field(default_factory=list)


def with_host_tensors(
    tensors: ModelStateTensors, on_host: Callable[[Any], bool]
) -> ModelStateTensors:
    """The same tensors, with those `on_host` picks (moved by `engine.offload_states()`)
    counted on the host side of their category."""

    def split(device: list[Any], host: list[Any]) -> tuple[list[Any], list[Any]]:
        return [t for t in device if not on_host(t)], host + [t for t in device if on_host(t)]

    params, host_params = split(tensors.params, tensors.host_params)
    grads, host_grads = split(tensors.grads, tensors.host_grads)
    optimizer, host_optimizer = split(tensors.optimizer, tensors.host_optimizer)
    return ModelStateTensors(params, grads, optimizer, host_params, host_grads, host_optimizer)


def model_state_bytes(tensors: ModelStateTensors) -> ModelStateBytes:
    """Bytes per category, each storage counted once (in the first category it appears in)."""
    counter = _StorageCounter()
    return ModelStateBytes(
        params=counter.count(tensors.params),
        grads=counter.count(tensors.grads),
        optimizer=counter.count(tensors.optimizer),
        host_params=counter.count(tensors.host_params),
        host_grads=counter.count(tensors.host_grads),
        host_optimizer=counter.count(tensors.host_optimizer),
    )


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Every tensor in an optimizer's per-parameter state (Adam's moments, step counts)."""
    return _state_tensors(optimizer)


def plain_model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> ModelStateBytes:
    """The same accounting for a model trained without zerodp (DDP and the other engines)."""
    counter = _StorageCounter()
    params = counter.count(model.parameters())
    grads = counter.count(p.grad for p in model.parameters() if p.grad is not None)
    state = counter.count(_state_tensors(optimizer)) if optimizer is not None else 0
    return ModelStateBytes(params=params, grads=grads, optimizer=state)


def ideal_offload_bytes(
    num_params: int, stage: int, world_size: int, *, mixed: bool, offload_params: bool = False
) -> tuple[int, int]:
    """The ZeRO-Offload figures per rank for Adam: (device bytes, host bytes).

    The device keeps parameters and gradients (sharded as the stage shards them;
    with `offload_params` at stage 3 the parameter shard moves to the host too);
    the host keeps the fp32 copy and Adam's moments of the owned range: 12/N bytes
    per parameter at stages 1-3.
    """
    p_bytes, g_bytes = (2, 2) if mixed else (4, 4)
    n = world_size
    device_params = p_bytes / n if stage == 3 else p_bytes
    device_grads = g_bytes / n if stage >= 2 else g_bytes
    host = 12 / n + (device_params if offload_params and stage == 3 else 0)
    if offload_params and stage == 3:
        device_params = 0
    return round((device_params + device_grads) * num_params), round(host * num_params)


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
