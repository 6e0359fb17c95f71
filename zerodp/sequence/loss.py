"""The loss of a sequence split S ways: local sums over one global count, summed once.

[Note: sequence-parallel loss]
One process computes a causal LM loss as sum(token losses) / N, N the number of
target tokens (labels not -100) of the micro-batch, after shifting the labels
by one. Split S ways, rank s holds the token losses of its slice, so the loss
is sum over s of (rank s's sum / N): every rank divides its own sum by the
global N (which every rank can count itself: each holds the whole batch's
labels), and the S parts add up to the one-process loss. A rank whose slice
has no target token contributes 0, not 0 / 0. The labels are shifted before
the sequence is split, so the last target of a slice is the first token of
the next slice.

Each rank's backward runs from its own part only; the reduction then sums the
parts' gradients over the sequence group (rule 1 of [Note: parallel
dimensions]). The value a forward returns as `.loss` is the sum of the parts
(`sum_over_sequence`): the whole sequence's loss on every rank, with the
gradient of this rank's part.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.comm import Comm


class _SumOverSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, comm: Comm) -> torch.Tensor:
        total = part.detach().clone()
        comm.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_sequence(part: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The sum of every sequence rank's `part` as this rank's value; its gradient flows to
    this rank's `part` only (see [Note: sequence-parallel loss])."""
    if comm.world_size == 1:
        return part
    return _SumOverSequence.apply(part, comm)


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The target of each position: the next token's label, `ignore_index` at the end (as
    transformers' causal LM loss shifts them), computed before the sequence is split."""
    tail = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], tail], dim=1)


def count_targets(shifted: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """N of [Note: sequence-parallel loss]: the target tokens of the whole micro-batch."""
    return (shifted != ignore_index).sum()
