"""The rules of the parallel dimensions that say how a checkpoint's saved parts combine.

Part of `ParallelDims` (it inherits them; rules 7 and 8 of [Note: parallel dimensions] in
`zerodp.parallel.dims`), kept in a module of their own: a checkpoint records its dims
(`to_record`), and a load asks the saved dims how the saved parts make up each value
(`window_sum_sources`, `tensor_slices`) and whether they load back as saved
(`same_layout`). Nothing in `zerodp.checkpoint_io` counts ranks itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerodp.errors import ConfigError
from zerodp.parallel.tensor_slices import TensorSlices


@dataclass(frozen=True)
class SavedSums:
    """Saved per-rank sums that make up one value: `ranks`' parts, summed, over `divisor`."""

    ranks: tuple[int, ...]
    divisor: int


class SavedLayoutRules:
    """`ParallelDims`' checkpoint rules (see the module docstring); the sizes are its own."""

    world_size: int
    shard_group_size: int
    secondary_size: int
    sequence_size: int
    tensor_size: int
    expert_size: int

    @property
    def data_size(self) -> int:  # pragma: no cover - ParallelDims defines it
        raise NotImplementedError

    def window_sum_sources(self, tensor_rank: int, expert_rank: int | None = None) -> SavedSums:
        """Which saved ranks' local gradient sums make up one accumulation window's gradient
        of the slice of `tensor_rank` (and, for an expert slice, of the experts of
        `expert_rank`), and what their sum is divided by (rule 1: summed over the sequence
        ranks, averaged over the D data ranks; an expert's summed over the ranks holding the
        same experts, which hold every data rank's contributions, over D too).

        These dims are the ones a checkpoint was saved with (`from_record`): a checkpoint
        taken inside a window at stages 0-1 keeps each rank's local sum, and a load into
        another layout or stage combines them as the boundary's reduction would have. A
        weight the plan leaves whole has the same sums on every tensor rank: tensor rank 0's
        serve a load under another T.
        """
        if not 0 <= tensor_rank < self.tensor_size:
            raise ValueError(f"tensor rank {tensor_rank} of a tensor group of {self.tensor_size}")
        ranks = tuple(range(tensor_rank, self.world_size, self.tensor_size))
        if expert_rank is not None:
            if not 0 <= expert_rank < self.expert_size:
                raise ValueError(f"EP rank {expert_rank} of an EP group of {self.expert_size}")
            e = self.expert_size
            ranks = tuple(
                r
                for r in ranks
                if (r // self.tensor_size) % self.shard_group_size % e == expert_rank
            )
        return SavedSums(ranks, self.data_size)

    def tensor_slices(self, whole_shape: tuple[int, ...], dim: int) -> TensorSlices:
        """How a weight of `whole_shape` split along `dim` is cut over the T tensor ranks
        (rule 8; T = 1: one part); `ValueError` when T does not divide that dimension."""
        return TensorSlices.of(tuple(whole_shape), dim, self.tensor_size)

    def whole_shape(self, slice_shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
        """The whole weight's shape from a tensor rank's slice of it along `dim` (rule 8)."""
        return TensorSlices.whole_shape_of(tuple(slice_shape), dim, self.tensor_size)

    def to_record(self) -> dict[str, int]:
        """The sizes, as a checkpoint records them (rank-independent)."""
        return {
            "world_size": self.world_size,
            "shard_group_size": self.shard_group_size,
            "secondary_size": self.secondary_size,
            "sequence_size": self.sequence_size,
            "tensor_size": self.tensor_size,
            "expert_size": self.expert_size,
        }

    @classmethod
    def from_record(cls, record: object, rank: int = 0) -> Any:
        """The dims a checkpoint recorded (`to_record`), checked; `ValueError` when damaged."""
        keys = ("world_size", "shard_group_size", "secondary_size", "sequence_size", "tensor_size")
        if not isinstance(record, dict) or not all(
            isinstance(record.get(k), int) and not isinstance(record.get(k), bool) for k in keys
        ):
            raise ValueError(f"a record of parallel dims has the integers {keys}, got {record!r}")
        world = record["world_size"]
        if world < 1 or record["shard_group_size"] < 1 or record["secondary_size"] < 1:
            raise ValueError(f"parallel dims out of range: {record!r}")
        expert = record.get("expert_size", 1)  # recorded since expert parallelism
        if not isinstance(expert, int) or isinstance(expert, bool):
            raise ValueError(f"a record of parallel dims has an integer expert_size: {record!r}")
        try:
            return cls.build(  # type: ignore[attr-defined]
                world,
                rank,
                shard_group_size=record["shard_group_size"],
                secondary_size=record["secondary_size"],
                sequence_size=record["sequence_size"],
                tensor_size=record["tensor_size"],
                expert_size=expert,
            )
        except ConfigError as caught:
            raise ValueError(f"parallel dims that do not fit: {caught}") from None

    @classmethod
    def from_replicas(cls, world_size: object, num_replicas: object) -> Any:
        """The dims of a checkpoint saved before dims were recorded, which kept a window only
        without sequence or tensor parallelism: `num_replicas` shard groups of data ranks;
        `ValueError` when they do not divide the world."""
        if not (
            isinstance(world_size, int)
            and isinstance(num_replicas, int)
            and 1 <= num_replicas <= world_size
            and world_size % num_replicas == 0
        ):
            raise ValueError(f"{num_replicas!r} replicas of a world of {world_size!r} ranks")
        return cls.build(  # type: ignore[attr-defined]
            world_size, 0, shard_group_size=world_size // num_replicas
        )

    def same_layout(self, other: SavedLayoutRules) -> bool:
        """Whether `other` lays the ranks out as these dims do (ranks aside)."""
        return self.to_record() == other.to_record()
