"""Bytes and calls per collective kind: what every `Comm` counts, for benchmarks and tests.

Every collective zerodp issues goes through `Comm`, so the benchmarks and the
tests that check ZeRO's communication volume read one set of counters.
Bytes are those of the full (unsharded) tensor a collective operates on: an
all-reduce of n elements, a reduce-scatter whose input has n elements and an
all-gather whose output has n elements each count n * element size; an
all-to-all counts the bytes this rank sends to the others (its own split,
which never leaves the rank, is not counted), so that the sum over ranks is
the traffic.

A `Comm` over a subgroup (a shard, replica or hpZ group, see
`zerodp.comm.subgroups`) counts into its parent's `CommStats` under its own
`label`, so the totals stay in one place and each collective's group can still
be told apart.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

import torch


class CollectiveKind(enum.Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"


WORLD = "world"  # the label of a `Comm` over the default group


@dataclass
class CommStats:
    """Bytes and calls per collective kind since the last `reset()`, and bytes per group.

    `by_group` counts the bytes of each (group label, kind): "world", or the label of
    the subgroup a collective ran in ("shard", "replica", "secondary").
    """

    bytes: Counter[CollectiveKind] = field(default_factory=Counter)
    calls: Counter[CollectiveKind] = field(default_factory=Counter)
    by_group: Counter[tuple[str, CollectiveKind]] = field(default_factory=Counter)
    # The uneven-inputs agreements' bytes per group label ("world", "shard"): kept apart,
    # so that the figures above are the work's own ([Note: agreeing before a collective]).
    agreements: Counter[str] = field(default_factory=Counter)

    def record(self, kind: CollectiveKind, nbytes: int, label: str = WORLD) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1
        self.by_group[(label, kind)] += nbytes

    def record_agreement(self, label: str, nbytes: int) -> None:
        self.agreements[label] += nbytes

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.by_group.clear()
        self.agreements.clear()

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def bytes_of_group(self, label: str) -> int:
        """Bytes of the collectives that ran in the groups labelled `label`."""
        return sum(n for (group, _), n in self.by_group.items() if group == label)

    def group_snapshot(self) -> dict[str, dict[str, int]]:
        """{label: {kind: bytes}} for every group that carried any."""
        out: dict[str, dict[str, int]] = {}
        for (label, kind), nbytes in sorted(self.by_group.items(), key=lambda i: i[0][0]):
            if nbytes:
                out.setdefault(label, {})[kind.value] = nbytes
        return out

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {
            kind.value: {"bytes": self.bytes[kind], "calls": self.calls[kind]}
            for kind in CollectiveKind
        }


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
