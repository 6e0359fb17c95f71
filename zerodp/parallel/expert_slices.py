"""Which experts of an MoE layer an EP rank holds (rule 9 of [Note: parallel dimensions]):
the experts cut into E equal, consecutive ranges, EP rank k holding range k. The split of a
model and a checkpoint's window sums cut by this one rule, so they cannot disagree."""

from __future__ import annotations


def held_experts(num_experts: int, expert_size: int, expert_rank: int) -> range:
    """The experts (indices along the experts' dimension) EP rank `expert_rank` of
    `expert_size` holds; `ValueError` when E does not divide the experts (the config's
    check names the fix before this is reached)."""
    if num_experts % expert_size or not 0 <= expert_rank < expert_size:
        raise ValueError(
            f"EP rank {expert_rank} of {expert_size} cannot hold an equal share of "
            f"{num_experts} experts"
        )
    local = num_experts // expert_size
    return range(expert_rank * local, (expert_rank + 1) * local)
