"""Where each parameter's elements sit in DeepSpeed's flat fp32 partitions.

DeepSpeed flattens the trainable parameters of each flat group (a param
group at stages 1-2, a sub-group at stage 3) in the order `param_shapes`
lists them, and gives each rank a partition:

- Stages 1-2: the group's parameters end to end (with an optional alignment
  gap after each, `param_alignment_paddings`), padded at the end to a
  multiple of the ranks; rank r holds elements [r * P, (r + 1) * P). A
  parameter may straddle partitions, so it may lie in pieces on two or more
  ranks.
- Stage 3: every parameter on its own is split in N parts of ceil(numel / N)
  (the last one padded); rank r's partition of a group is its part of each
  parameter, one after the other.

`DeepSpeedLayout.fragments(name)` lists the pieces of one parameter: which
rank's file, which flat group, where in that partition, and which part of the
flattened parameter. It is arithmetic on sizes only; `check_against` holds
it against the partitions a file actually has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerodp.errors import CheckpointError


@dataclass(frozen=True)
class Fragment:
    """Elements [param_start, param_start + numel) of a flattened parameter, stored in rank
    `rank`'s partition of flat group `group` at [start, start + numel)."""

    rank: int
    group: int
    start: int
    param_start: int
    numel: int


class DeepSpeedLayout:
    """The fragments of every trainable parameter of a DeepSpeed ZeRO checkpoint."""

    def __init__(self) -> None:
        self._fragments: dict[str, list[Fragment]] = {}
        self._group: dict[str, int] = {}
        self._numel: dict[str, int] = {}

    @classmethod
    def stage12(
        cls,
        flat_groups: list[list[tuple[str, int]]],
        world_size: int,
        partition_numels: list[int],
        alignment_paddings: list[list[int]] | None,
    ) -> DeepSpeedLayout:
        """`partition_numels[g]`: P, the elements of each rank's partition of group `g`."""
        layout = cls()
        for group, params in enumerate(flat_groups):
            size = partition_numels[group]
            gaps = alignment_paddings[group] if alignment_paddings is not None else None
            if gaps is not None and len(gaps) != len(params):
                raise CheckpointError(
                    f"flat group {group}: {len(gaps)} alignment paddings for {len(params)} "
                    "parameters; the checkpoint's layout is not one zerodp knows"
                )
            offset = 0
            for index, (name, numel) in enumerate(params):
                pieces = []
                for rank in range(world_size):
                    lo, hi = max(offset, rank * size), min(offset + numel, (rank + 1) * size)
                    if lo < hi:
                        pieces.append(Fragment(rank, group, lo - rank * size, lo - offset, hi - lo))
                layout._add(name, group, numel, pieces)
                offset += numel + (gaps[index] if gaps is not None else 0)
            if offset > world_size * size:
                raise CheckpointError(
                    f"flat group {group} holds {offset} elements but {world_size} partitions of "
                    f"{size} hold only {world_size * size}; the checkpoint is damaged"
                )
        return layout

    @classmethod
    def stage3(cls, flat_groups: list[list[tuple[str, int]]], world_size: int) -> DeepSpeedLayout:
        layout = cls()
        for group, params in enumerate(flat_groups):
            offset = 0
            for name, numel in params:
                part = math.ceil(numel / world_size)
                pieces = []
                for rank in range(world_size):
                    lo, hi = rank * part, min((rank + 1) * part, numel)
                    if lo < hi:
                        pieces.append(Fragment(rank, group, offset, lo, hi - lo))
                layout._add(name, group, numel, pieces)
                offset += part
        return layout

    def _add(self, name: str, group: int, numel: int, pieces: list[Fragment]) -> None:
        if name in self._fragments:
            raise CheckpointError(
                f"parameter '{name}' appears twice in the checkpoint's param_shapes; it is damaged"
            )
        self._fragments[name] = pieces
        self._group[name] = group
        self._numel[name] = numel

    @property
    def names(self) -> list[str]:
        return list(self._fragments)

    def fragments(self, name: str) -> list[Fragment]:
        return self._fragments[name]

    def group_of(self, name: str) -> int:
        return self._group[name]

    def ranks_holding(self, name: str, start: int, end: int) -> set[int]:
        """The ranks whose files hold some of elements [start, end) of `name`."""
        return {
            f.rank
            for f in self._fragments[name]
            if f.param_start < end and start < f.param_start + f.numel
        }

    def check_against(self, rank: int, usable: list[int], where: str) -> None:
        """Every fragment of rank `rank` lies within the partitions its file holds."""
        for name, pieces in self._fragments.items():
            for piece in pieces:
                if piece.rank != rank:
                    continue
                if piece.group >= len(usable) or piece.start + piece.numel > usable[piece.group]:
                    raise CheckpointError(
                        f"{where}: parameter '{name}' should lie at [{piece.start}, "
                        f"{piece.start + piece.numel}) of flat group {piece.group}, which holds "
                        f"{usable[piece.group] if piece.group < len(usable) else 0} elements; "
                        "the checkpoint's files do not belong together, or one is damaged"
                    )
