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
from zerodp.group import GroupIndex, GroupState


class FullStateAccessor:
    """Answers "what is the full X of this parameter?" from the group records."""

    def __init__(
        self,
        *,
        comm: Comm,
        groups: GroupIndex,
        reducer: GradientReducer,
        optimizer: torch.optim.Optimizer,
        loss_scale: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.comm = comm
        self.groups = groups
        self.reducer = reducer
        self.optimizer = optimizer
        self.loss_scale = loss_scale

    def full_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The averaged gradient; under fp16 loss scaling, unscaled and in fp32."""
        found = self.groups.lookup(param)
        if found is None or found[0].grads is None:
            return None if param.grad is None else param.grad.detach().clone()
        grad = self.reducer.full_grad(*found)
        scale = self.loss_scale()
        return grad if scale == 1.0 else grad.float() / scale

    def full_fp32_param(self, param: nn.Parameter) -> torch.Tensor:
        found = self.groups.lookup(param)
        if found is None:
            return param.detach().float().clone()
        state, position = found
        return self._assemble(state, position, state.value_of_owned()).float()

    def set_full_fp32_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Every rank passes the same full value; no communication is needed."""
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"safe_set_full_fp32_param: value has shape {tuple(value.shape)}, the "
                f"parameter has {tuple(param.shape)}"
            )
        found = self.groups.lookup(param)
        with torch.no_grad():
            if found is None:
                param.copy_(value)
                return
            state, position = found
            flat = state.flat
            start, end = flat.slot_of(position)
            flat_value = value.detach().reshape(-1)
            if flat.full_is_allocated:
                flat.full[start:end].copy_(flat_value.to(flat.full))
            if not flat.persistent:
                self._write_owned_part(flat.shard, flat.shard_range, start, end, flat_value)
            copy = state.optim.copy if state.optim is not None else None
            if copy is not None:
                self._write_owned_part(copy, flat.owned_range, start, end, flat_value)

    def full_optimizer_state(self, param: nn.Parameter, key: str) -> torch.Tensor | None:
        found = self.groups.lookup(param)
        if found is None or found[0].optim is None:
            return None
        state, position = found
        owned = state.optim.param  # type: ignore[union-attr]
        value = self.optimizer.state.get(owned, {}).get(key)
        if not isinstance(value, torch.Tensor) or value.numel() != owned.numel():
            return value
        return self._assemble(state, position, value)

    # -- helpers -------------------------------------------------------------------

    @staticmethod
    def _write_owned_part(
        target: torch.Tensor,
        target_range: tuple[int, int],
        start: int,
        end: int,
        flat_value: torch.Tensor,
    ) -> None:
        """Write the part of [start, end) that `target` (covering `target_range`) holds."""
        lo, hi = max(start, target_range[0]), min(end, target_range[1])
        if lo < hi:
            target[lo - target_range[0] : hi - target_range[0]].copy_(
                flat_value[lo - start : hi - start].to(target)
            )

    def _assemble(self, state: GroupState, position: int, owned: torch.Tensor) -> torch.Tensor:
        """One parameter's full value from a tensor covering this rank's owned range."""
        flat = state.flat
        start, end = flat.slot_of(position)
        shape = flat.layout.slots[position].shape
        if owned.numel() == flat.padded_numel:
            return owned[start:end].clone().view(shape)
        full = torch.empty(flat.padded_numel, dtype=owned.dtype, device=owned.device)
        self.comm.all_gather(full, owned)
        return full[start:end].clone().view(shape)
