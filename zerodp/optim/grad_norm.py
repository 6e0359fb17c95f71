"""The global gradient norm over every rank's shards, and clipping by it."""

from __future__ import annotations

import torch

from zerodp.comm import Comm


def global_grad_norm(grads: list[torch.Tensor], comm: Comm, sharded: bool) -> torch.Tensor:
    """The 2-norm of the full gradient; `grads` are this rank's (padded with zeros) pieces.

    When the pieces are shards (`sharded`), squared norms are summed over ranks;
    when every rank holds the whole gradient, no communication is needed.
    Returns a 0-d fp32 tensor on the gradients' device (no host synchronisation).
    """
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads, 2)
    total_sq = torch.stack([n.float() for n in norms]).square().sum()
    if sharded:
        comm.all_reduce(total_sq)
    return total_sq.sqrt()


def clip_by_global_norm(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients in place so that their global norm is at most `max_norm`."""
    if max_norm <= 0 or not grads:
        return
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
