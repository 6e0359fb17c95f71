"""The router's choice as a list of (token, expert) assignments, ordered by expert.

A router picks K experts for each of T tokens (`top_k_index` [T, K]); each of
the T x K slots is one assignment. Ordered by global expert index, the
assignments fall into consecutive runs, one per EP rank (rank r holds experts
[r * n, (r + 1) * n)), and inside a run one per local expert, which is the
order the all-to-all sends them in. A slot whose index lies outside [0, N)
(a model's own sentinel for a masked slot) is no assignment: it is sent
nowhere and contributes nothing, as in the model's own forward. Pure local
arithmetic, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Assignments:
    """The valid slots of one forward, ordered by expert (stable: slot order within one).

    `slots`: their positions among the T x K slots; `tokens`: the token of each (slot // K).
    """

    slots: torch.Tensor
    tokens: torch.Tensor


def order_by_expert(top_k_index: torch.Tensor, num_experts: int, count: int) -> Assignments:
    """The assignments of `top_k_index` [T, K] (indices into `num_experts` experts), in expert
    order; `count` is how many are valid (the sum of `per_expert`, known on the host)."""
    # Invalid slots sort last under the key N, after every real expert.
    _, order = torch.sort(_expert_key(top_k_index, num_experts), stable=True)
    slots = order[:count]
    return Assignments(slots, torch.div(slots, top_k_index.shape[-1], rounding_mode="floor"))


def expert_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many slots of `top_k_index` name each of the `num_experts` experts (int64, [N]);
    slots outside [0, N) are not counted."""
    key = _expert_key(top_k_index, num_experts)
    return torch.bincount(key, minlength=num_experts + 1)[:num_experts].to(torch.int64)


def _expert_key(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each slot's expert, N for a slot outside [0, N)."""
    flat = top_k_index.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    return torch.where(valid, flat, torch.full_like(flat, num_experts))


def local_expert_index(received: torch.Tensor, local_experts: int) -> torch.Tensor:
    """The local expert of each row an EP rank receives, from `received` [E, n]: how many rows
    each source rank sends to each of this rank's n experts (rows arrive by source rank, and
    from one source by local expert)."""
    experts = torch.arange(local_experts, device=received.device).repeat(received.shape[0])
    return torch.repeat_interleave(experts, received.reshape(-1))
