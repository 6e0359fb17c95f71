"""The expert-parallel group an experts module works in: its `Comm`, this rank's place, the size.

The E ranks of an expert-parallel (EP) group read different tokens and each
holds E-th of the experts of every MoE layer: the rank at place e of the group
holds experts [e * n, (e + 1) * n) of N, n = N / E. Which ranks form a group,
and in which order, is the caller's (the engine asks `ParallelDims`); the
group's `Comm` numbers its ranks in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerodp.comm import Comm


@dataclass(frozen=True)
class ExpertGroup:
    """An EP group seen from one rank: its `Comm`, this rank's place `rank`, and `size` (E).

    Copying a split model copies its experts modules, never the group: a copy of a split
    model communicates in the same group (`__deepcopy__` returns the group itself).
    """

    comm: Comm
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"expert-parallel place {self.rank} of {self.size} ranks is not one")
        if self.comm.world_size != self.size or self.comm.rank != self.rank:
            raise ValueError(
                f"internal error: the expert-parallel group's Comm has rank {self.comm.rank} of "
                f"{self.comm.world_size}, but the split was asked for place {self.rank} of "
                f"{self.size}; pass the Comm of this rank's expert-parallel group"
            )

    def __deepcopy__(self, memo: dict[int, Any]) -> ExpertGroup:
        return self
