"""Full (unsharded) views of one parameter's gradient, fp32 value and optimizer state.

These back `zerodp.utils.safe_get_full_*`: each is a collective (every rank
calls it for the same parameter) that assembles the full tensor from the
ranks' shards, so user code can inspect or set one parameter whatever the stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerodp.backward.reducer import GradientReducer
from zerodp.comm import Comm
from zerodp.group_state import GroupIndex, GroupState
from zerodp.optim.tensorwise import ALL_RANKS, TensorTask, TensorwiseStep


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
        tensorwise: TensorwiseStep | None = None,
    ) -> None:
        self.comm = comm
        self.groups = groups
        self.reducer = reducer
        self.optimizer = optimizer
        self.loss_scale = loss_scale
        self.tensorwise = tensorwise

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
        if found is None:
            with torch.no_grad():
                param.copy_(value)
            return
        found[0].write_param(found[1], value)

    def full_optimizer_state(self, param: nn.Parameter, key: str) -> torch.Tensor | None:
        """The whole state `key` of `param`; for a parameter stepped whole, in the shape the
        optimizer keeps it (Adafactor's row moment of a matrix is rows x 1), sent by its owner."""
        found = self.groups.lookup(param)
        if found is None or found[0].optim is None:
            return None
        state, position = found
        whole = self._whole(state, position)
        if whole is not None:
            task, stepped = whole
            value = None if stepped is None else self.optimizer.state.get(stepped, {}).get(key)
            if task.owner == ALL_RANKS:  # stage 0: every rank holds it
                return _detached(value)
            sent = self.comm.broadcast_object(_detached(value, "cpu"), src=task.owner)
            return sent if not isinstance(sent, torch.Tensor) else sent.to(state.flat.device)
        owned = state.optim.param  # type: ignore[union-attr]
        value = self.optimizer.state.get(owned, {}).get(key)
        if not isinstance(value, torch.Tensor) or value.numel() != owned.numel():
            return value
        return self._assemble(state, position, value)

    # -- this rank's part (no communication) --------------------------------------------

    def local_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's part of the kept gradient of `param`, flattened (unscaled, like full_grad).

        Between accumulation boundaries at stages 0 and 1 (before the boundary's
        reduction) it is this rank's own sum, not yet averaged; at stages 2 and 3 with
        shard groups that replicate each other, its shard group's average (see [Note:
        shard groups] in `zerodp.comm.topology`).
        """
        found = self.groups.lookup(param)
        if found is None or found[0].grads is None:
            return None if param.grad is None else param.grad.detach().reshape(-1).clone()
        state, position = found
        grad = self._owned_part(state, position, state.grads.owned()).clone()  # type: ignore[union-attr]
        scale = self.loss_scale()
        return grad if scale == 1.0 else grad.float() / scale

    def local_fp32_param(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's part of `param`'s fp32 value (the master copy), flattened."""
        found = self.groups.lookup(param)
        if found is None:
            return param.detach().float().reshape(-1).clone()
        state, position = found
        return self._owned_part(state, position, state.value_of_owned()).float().clone()

    def local_optimizer_state(self, param: nn.Parameter, key: str) -> torch.Tensor | None:
        """This rank's part of the optimizer state `key` of `param` (scalar state as it is);
        for a parameter stepped whole, the whole state flattened on the rank that steps it,
        None on the others."""
        found = self.groups.lookup(param)
        if found is None or found[0].optim is None:
            return None
        state, position = found
        whole = self._whole(state, position)
        if whole is not None:
            stepped = whole[1]
            value = None if stepped is None else self.optimizer.state.get(stepped, {}).get(key)
            return value.detach().reshape(-1).clone() if isinstance(value, torch.Tensor) else value
        owned = state.optim.param  # type: ignore[union-attr]
        value = self.optimizer.state.get(owned, {}).get(key)
        if not isinstance(value, torch.Tensor) or value.numel() != owned.numel():
            return value
        return self._owned_part(state, position, value).clone()

    def _whole(
        self, state: GroupState, position: int
    ) -> tuple[TensorTask, nn.Parameter | None] | None:
        """(the plan's task, this rank's whole-tensor parameter or None) for a parameter an
        optimizer steps whole; None for one stepped on flat shards."""
        if self.tensorwise is None:
            return None
        return self.tensorwise.task_and_param(state.order, position)

    @staticmethod
    def _owned_part(state: GroupState, position: int, owned: torch.Tensor) -> torch.Tensor:
        """The part of parameter `position` inside a tensor covering this rank's owned range."""
        flat = state.flat
        start, end = flat.slot_of(position)
        lo, hi = flat.owned_range
        first = max(start, lo)
        return owned[first - lo : max(min(end, hi), first) - lo]

    def _assemble(self, state: GroupState, position: int, owned: torch.Tensor) -> torch.Tensor:
        """One parameter's full value from a tensor covering this rank's owned range."""
        flat = state.flat
        start, end = flat.slot_of(position)
        shape = flat.layout.slots[position].shape
        if owned.numel() == flat.padded_numel:
            return owned[start:end].clone().view(shape)
        full = torch.empty(flat.padded_numel, dtype=owned.dtype, device=owned.device)
        state.comm.all_gather(full, owned)
        return full[start:end].clone().view(shape)


def _detached(value: Any, device: str | None = None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone() if device is None else value.detach().to(device, copy=True)
