"""The collectives of the split layers, as autograd functions on zerodp's own `Comm`.

[Note: tensor-parallel communication]
Every rank of a tensor group computes the same loss from the same batch, so a
value the group holds whole (a replicated activation) has one gradient, which
every rank holds whole too. Four functions move values between that whole form
and the split forms of the layers:

- `copy_to_group`: a whole input entering a column-parallel layer. Forward:
  identity. Backward: each rank's slice yields only its part of the input's
  gradient, so the parts are summed (all-reduce).
- `reduce_from_group`: the partial sums a row-parallel layer (or a
  vocabulary-parallel embedding) makes. Forward: all-reduce, so every rank holds
  the whole output. Backward: identity (the gradient is whole already).
- `gather_from_group`: a column-parallel output wanted whole (an lm_head whose
  logits the loss reads). Forward: all-gather along the last dimension.
  Backward: each rank keeps its own slice of the gradient.
- `split_to_group`: the reverse of the gather (its backward).

Each function's backward is its partner's forward, written as the partner
itself, so a backward run with `create_graph=True` builds a graph that can be
differentiated again (double backward). A column-parallel / row-parallel pair
costs one all-reduce forward and one backward, as in Megatron-LM: the
column-parallel layers that read the same input one after the other (q, k and v;
gate and up) share one `copy_to_group` of it (`TensorGroup.copy_in`), so
autograd adds their partial gradients locally and one all-reduce sums them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from zerodp.comm import Comm


@dataclass(frozen=True)
class TensorGroup:
    """The tensor-parallel group a split layer works in: its `Comm`, this rank's place, the size.

    Copying a model copies its layers, never the group: a copy of a split model
    communicates in the same group (`__deepcopy__` returns the group itself).
    """

    comm: Comm
    rank: int
    size: int
    _last_copy: list[tuple[weakref.ref[torch.Tensor], torch.Tensor]] = field(
        default_factory=list, compare=False, repr=False
    )

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorGroup:
        return self

    def copy_in(self, value: torch.Tensor) -> torch.Tensor:
        """`copy_to_group(value)`, shared with the previous layer that read the same tensor.

        Only the last input is remembered: the layers that share an input run one after
        the other. `forget()` (at the end of the model's forward) drops it, so that no
        graph outlives its forward here. Without autograd there is nothing to copy.
        """
        if not (torch.is_grad_enabled() and value.requires_grad):
            return value
        if self._last_copy:
            source, earlier = self._last_copy[0]
            if source() is value:
                return earlier
        copied = copy_to_group(value, self)
        self._last_copy[:] = [(weakref.ref(value), copied)]
        return copied

    def forget(self) -> None:
        """Drop the remembered input (see `copy_in`)."""
        self._last_copy.clear()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        ctx.group = group
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _ReduceFromGroup.apply(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        ctx.group = group
        out = value.contiguous().clone()
        group.comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _CopyToGroup.apply(grad, ctx.group), None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        ctx.group = group
        local = value.contiguous()
        stacked = torch.empty((group.size, *local.shape), dtype=local.dtype, device=local.device)
        group.comm.all_gather(stacked.view(-1), local.view(-1))
        return torch.cat(stacked.unbind(0), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _SplitToGroup.apply(grad, ctx.group), None


class _SplitToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        ctx.group = group
        return value.chunk(group.size, dim=-1)[group.rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _GatherFromGroup.apply(grad, ctx.group), None


def copy_to_group(value: torch.Tensor, group: TensorGroup) -> torch.Tensor:
    """Identity forward, all-reduce backward (see [Note: tensor-parallel communication])."""
    out: torch.Tensor = _CopyToGroup.apply(value, group)
    return out


def reduce_from_group(value: torch.Tensor, group: TensorGroup) -> torch.Tensor:
    """All-reduce forward, identity backward (see [Note: tensor-parallel communication])."""
    out: torch.Tensor = _ReduceFromGroup.apply(value, group)
    return out


def gather_from_group(value: torch.Tensor, group: TensorGroup) -> torch.Tensor:
    """All-gather along the last dimension forward, own slice backward."""
    out: torch.Tensor = _GatherFromGroup.apply(value, group)
    return out


def split_to_group(value: torch.Tensor, group: TensorGroup) -> torch.Tensor:
    """Own slice of the last dimension forward, all-gather backward."""
    out: torch.Tensor = _SplitToGroup.apply(value, group)
    return out


@torch.no_grad()
def gather_whole(local: torch.Tensor, group: TensorGroup, dim: int) -> torch.Tensor:
    """The whole tensor of which every rank of `group` holds slice `rank` along `dim`
    (a collective, outside autograd: for export and checks)."""
    local = local.contiguous()
    stacked = torch.empty((group.size, *local.shape), dtype=local.dtype, device=local.device)
    group.comm.all_gather(stacked.view(-1), local.view(-1))
    return torch.cat(stacked.unbind(0), dim=dim)
