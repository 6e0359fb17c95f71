"""Full (unsharded) views of one parameter's gradient, fp32 value and optimizer state.

These back `zerodp.utils.safe_get_full_*`: each is a collective (every rank
calls it for the same parameter) that assembles the full tensor from the
ranks' shards, so user code can inspect or set one parameter whatever the stage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerodp.backward.reducer import GradientReducer
from zerodp.comm import Comm
from zerodp.params.runtime import Stage3Runtime
from zerodp.partition import FlatGroup
from zerodp.precision.master import MasterWeights


class FullStateAccessor:
    def __init__(
        self,
        *,
        comm: Comm,
        reducer: GradientReducer,
        groups: list[FlatGroup],
        shard_params: dict[int, nn.Parameter],  # id(FlatGroup) -> the optimizer's parameter
        optimizer: torch.optim.Optimizer,
        owns_full_group: bool,
        stage3: Stage3Runtime | None,
        masters: MasterWeights | None = None,
        loss_scale: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.comm = comm
        self.reducer = reducer
        self.shard_params = shard_params
        self.optimizer = optimizer
        self.owns_full_group = owns_full_group
        self.stage3 = stage3
        self.masters = masters
        self.loss_scale = loss_scale
        self._where: dict[int, tuple[FlatGroup, int]] = {
            id(p): (g, i) for g in groups for i, p in enumerate(g.params)
        }

    def full_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The averaged gradient; under fp16 loss scaling, unscaled and in fp32."""
        if not self.reducer.manages(param):
            return None if param.grad is None else param.grad.detach().clone()
        grad = self.reducer.full_grad(param)
        scale = self.loss_scale()
        return grad if scale == 1.0 else grad.float() / scale

    def full_fp32_param(self, param: nn.Parameter) -> torch.Tensor:
        where = self._where.get(id(param))
        if where is None:
            return param.detach().float().clone()
        group, position = where
        owned = self._owned_value(group)
        return self._assemble(group, position, owned).float()

    def set_full_fp32_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Every rank passes the same full value; no communication is needed."""
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"safe_set_full_fp32_param: value has shape {tuple(value.shape)}, the "
                f"parameter has {tuple(param.shape)}"
            )
        where = self._where.get(id(param))
        with torch.no_grad():
            if where is None:
                param.copy_(value)
                return
            group, position = where
            start, end = group.slot_of(position)
            flat_value = value.detach().reshape(-1).to(group.device)
            if group.full_is_allocated:
                group.full[start:end].copy_(flat_value)
            shard_start, shard_end = group.shard_range
            lo, hi = max(start, shard_start), min(end, shard_end)
            if group.separate_shard and lo < hi:
                group.shard[lo - shard_start : hi - shard_start].copy_(
                    flat_value[lo - start : hi - start]
                )
            master = self.masters.master_of(group) if self.masters is not None else None
            if master is not None:
                # The master holds the owned range in fp32: the whole group at stage 0.
                if master.numel() == group.padded_numel:
                    master[start:end].copy_(value.detach().reshape(-1).to(master))
                elif lo < hi:
                    master[lo - shard_start : hi - shard_start].copy_(
                        value.detach().reshape(-1)[lo - start : hi - start].to(master)
                    )

    def full_optimizer_state(self, param: nn.Parameter, key: str) -> torch.Tensor | None:
        where = self._where.get(id(param))
        if where is None:
            return None
        group, position = where
        shard = self.shard_params.get(id(group))
        if shard is None:
            return None
        state = self.optimizer.state.get(shard, {}).get(key)
        if not isinstance(state, torch.Tensor) or state.numel() != shard.numel():
            return state
        return self._assemble(group, position, state)

    # -- helpers -------------------------------------------------------------------

    def _owned_value(self, group: FlatGroup) -> torch.Tensor:
        shard = self.shard_params.get(id(group))
        if shard is not None:
            return shard.detach()
        if self.stage3 is not None:  # a frozen stage 3 group: no optimizer parameter
            return group.shard
        return group.full

    def _assemble(self, group: FlatGroup, position: int, owned: torch.Tensor) -> torch.Tensor:
        start, end = group.slot_of(position)
        shape = group.layout.slots[position].shape
        if owned.numel() == group.padded_numel:
            return owned[start:end].clone().view(shape)
        full = torch.empty(group.padded_numel, dtype=owned.dtype, device=owned.device)
        self.comm.all_gather(full, owned)
        return full[start:end].clone().view(shape)
