"""The all-to-all of Ulysses attention, with autograd: sequence shards <-> head shards.

[Note: Ulysses all-to-all]
Each of the S ranks of a sequence group holds L/S consecutive tokens of every
attention head. Before attention, one all-to-all gives each rank every token of
H/S heads: rank r cuts its tensor into S blocks along the head dimension, sends
block j to rank j, and lays the S blocks it receives one after the other along
the sequence dimension (rank order is token order: rule 5 of [Note: parallel
dimensions] in `zerodp.parallel.dims`). After attention, the inverse
all-to-all (cut along the sequence, lay along the heads) brings each rank its
own tokens of every head back. The backward of an all-to-all is the inverse
all-to-all of the gradient, so one autograd Function serves both directions,
and its backward is itself differentiable (a gradient penalty through
attention works).

It runs on zerodp's own `Comm` (counted in its byte stats under the sequence
group's label). torch's differentiable all-to-all (`torch.distributed.nn`) is
emulated with `scatter` on gloo and fails on subgroups that do not start at
rank 0, which every sequence group but the first is.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.comm import Comm


def exchange(x: torch.Tensor, comm: Comm, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Cut `x` into `comm.world_size` blocks along `split_dim`, send block j to rank j, and
    concatenate the blocks received (in rank order) along `cat_dim`."""
    size = comm.world_size
    if x.shape[split_dim] % size != 0:
        raise ValueError(
            f"internal error: dimension {split_dim} of a {tuple(x.shape)} tensor does not split "
            f"into {size} equal blocks"
        )
    send = torch.stack(x.chunk(size, dim=split_dim)).contiguous()
    received = torch.empty_like(send)
    block = send[0].numel()
    comm.all_to_all(received.view(-1), send.view(-1), [block] * size, [block] * size)
    return torch.cat(received.unbind(0), dim=cat_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: Comm, split_dim: int, cat_dim: int
    ) -> torch.Tensor:
        ctx.comm, ctx.split_dim, ctx.cat_dim = comm, split_dim, cat_dim
        return exchange(x, comm, split_dim, cat_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The inverse exchange, itself through the Function so that it can be differentiated.
        return _AllToAll.apply(grad, ctx.comm, ctx.cat_dim, ctx.split_dim), None, None, None


def all_to_all(x: torch.Tensor, comm: Comm, split_dim: int, cat_dim: int) -> torch.Tensor:
    """`exchange` with autograd (see [Note: Ulysses all-to-all])."""
    if comm.world_size == 1:
        return x
    return _AllToAll.apply(x, comm, split_dim, cat_dim)


def sequence_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """(batch, heads, local tokens, dim) -> (batch, heads / S, all tokens, dim)."""
    return all_to_all(x, comm, split_dim=1, cat_dim=2)


def heads_to_sequence(
    x: torch.Tensor, comm: Comm, *, heads_dim: int, sequence_dim: int
) -> torch.Tensor:
    """An attention output with all tokens of heads / S heads -> this rank's tokens of every
    head (the dimensions as the attention function lays them out)."""
    return all_to_all(x, comm, split_dim=sequence_dim, cat_dim=heads_dim)
