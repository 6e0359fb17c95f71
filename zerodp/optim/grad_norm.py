"""The global gradient norm over every rank's shards, and clipping by it."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from zerodp.comm import Comm
from zerodp.comm.subgroups import GroupComms
from zerodp.partition import Slicing


@dataclass(frozen=True)
class NormReduction:
    """The groups a squared norm is summed over so that each gradient element counts once.

    Asked of the parallel dims (rule 2 of [Note: parallel dimensions] in
    `zerodp.parallel.dims`), never decided here.
    """

    sum_over: tuple[Comm, ...] = ()

    @classmethod
    def of(
        cls, comms: GroupComms, *, sharded: bool, slicing: Slicing = Slicing.WHOLE
    ) -> NormReduction:
        """For gradients this rank holds a shard of (`sharded`) or the whole of, of whole
        tensors or of tensor- or expert-parallel slices (`slicing`)."""
        labels = comms.dims.norm_sum_groups(
            sharded=sharded,
            tensor_split=slicing is Slicing.TENSOR,
            expert=slicing is Slicing.EXPERT,
        )
        found = (comms.of(label) for label in labels)
        return cls(tuple(comm for comm in found if comm is not None))

    @classmethod
    def per_slicing(cls, comms: GroupComms, *, sharded: bool) -> dict[Slicing, NormReduction]:
        """One reduction per kind of flat group: their squares are summed over different
        groups, then added."""
        return {kind: cls.of(comms, sharded=sharded, slicing=kind) for kind in Slicing}


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """foreach kernels take tensors of one device; offload mixes host and device gradients."""
    groups: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        groups[tensor.device].append(tensor)
    return groups


def squared_grad_norm(
    grads: list[torch.Tensor], reduction: NormReduction, device: torch.device | None = None
) -> torch.Tensor:
    """The squared 2-norm of the gradients `grads` are this rank's (zero-padded) pieces of.

    Squared norms are summed over the groups `reduction` names (none when every rank
    holds the whole gradient: no communication then).
    Returns a 0-d fp32 tensor on `device` (default: the first gradient's), without a
    host synchronisation when every gradient is on that device.
    """
    if not grads:
        return torch.zeros((), device=device)
    target = device or grads[0].device
    squares = []
    for tensors in _by_device(grads).values():
        norms = torch._foreach_norm(tensors, 2)
        squares.append(torch.stack([n.float() for n in norms]).square().to(target))
    total_sq = torch.cat(squares).sum()
    for comm in reduction.sum_over:
        comm.all_reduce(total_sq)
    return total_sq


def global_grad_norm(
    grads: list[torch.Tensor], reduction: NormReduction, device: torch.device | None = None
) -> torch.Tensor:
    """The 2-norm of the full gradient; see `squared_grad_norm`."""
    return squared_grad_norm(grads, reduction, device).sqrt()


def scale_grads(grads: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply every gradient in place by `factor` (a number or a 0-d tensor)."""
    for device, tensors in _by_device(grads).items():
        value = factor.to(device, tensors[0].dtype) if isinstance(factor, torch.Tensor) else factor
        torch._foreach_mul_(tensors, value)


def clip_by_global_norm(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients in place so that their global norm is at most `max_norm`."""
    if max_norm <= 0 or not grads:
        return
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    scale_grads(grads, coefficient)
