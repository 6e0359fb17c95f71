"""Where each parameter sits in a flat, padded buffer split evenly across ranks.

A group of parameters is flattened end to end; the total is padded up to a
multiple of the world size so that every rank owns one equal, contiguous
shard `[rank * shard_numel, (rank + 1) * shard_numel)`. A parameter may span
several shards; `overlap` says which part of it a rank owns. All of this is
arithmetic on sizes, tested without any process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat buffer."""

    offset: int
    numel: int
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ShardOverlap:
    """The part of one parameter that one rank's shard holds.

    `param_start:param_end` indexes the flattened parameter,
    `shard_start:shard_end` the rank's shard.
    """

    param_start: int
    param_end: int
    shard_start: int
    shard_end: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[ParamSlot, ...]
    world_size: int

    @classmethod
    def build(cls, shapes: list[tuple[int, ...]], world_size: int) -> FlatLayout:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        slots = []
        offset = 0
        for shape in shapes:
            numel = math.prod(shape)
            slots.append(ParamSlot(offset=offset, numel=numel, shape=tuple(shape)))
            offset += numel
        return cls(slots=tuple(slots), world_size=world_size)

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (no padding)."""
        return self.slots[-1].end if self.slots else 0

    @property
    def shard_numel(self) -> int:
        return max(1, math.ceil(self.numel / self.world_size))

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def overlap(self, slot_index: int, rank: int) -> ShardOverlap | None:
        """The part of parameter `slot_index` held by `rank`'s shard, or None."""
        slot = self.slots[slot_index]
        shard_start, shard_end = self.shard_range(rank)
        start = max(slot.offset, shard_start)
        end = min(slot.end, shard_end)
        if start >= end:
            return None
        return ShardOverlap(
            param_start=start - slot.offset,
            param_end=end - slot.offset,
            shard_start=start - shard_start,
            shard_end=end - shard_start,
        )

    def owners(self, slot_index: int) -> list[int]:
        """Ranks whose shards hold some of parameter `slot_index`."""
        return [r for r in range(self.world_size) if self.overlap(slot_index, r) is not None]
