"""The kept gradient of one trainable group, and what the running graph task put into it.

The data lives here, with the group; `zerodp.backward.reducer` is the one
writer (see [Note: gradient reduction] there).
"""

from __future__ import annotations

import enum

import torch

from zerodp.partition import FlatGroup


class GradSync(enum.Enum):
    """Whether a kept gradient is this rank's own sum or the average over ranks.

    LOCAL: this rank's unreduced sum (stages 0 and 1 between accumulation
        boundaries); reduced in place, once, by the boundary task.
    PARTIAL: averaged over this rank's shard group only (shard groups that
        replicate each other, between boundaries; see [Note: shard groups] in
        `zerodp.comm.topology`); averaged across the replica group in place,
        once, at the boundary. Later contributions are reduced in the shard
        group and added.
    AVERAGED: averaged over ranks; later contributions are reduced on their
        own and added (stages 2 and 3 without replicas always; every stage
        after the boundary reduction until `zero_grad()`).
    """

    LOCAL = "local"
    PARTIAL = "partial"
    AVERAGED = "averaged"


class TaskContribution:
    """What the running graph task has contributed to one group so far (reset per task)."""

    __slots__ = ("bucket", "bucket_written", "contributed", "launched", "num_contributed")

    def __init__(self, num_params: int) -> None:
        self.contributed = [False] * num_params
        self.num_contributed = 0
        self.launched = False  # its reduction is issued (or, for LOCAL, decided)
        self.bucket: torch.Tensor | None = None  # collects an AVERAGED group's contribution
        self.bucket_written = [False] * num_params

    @property
    def complete(self) -> bool:
        return self.num_contributed == len(self.contributed)

    def mark(self, position: int) -> bool:
        """Record a contribution of parameter `position`; True if it was its first."""
        if self.contributed[position]:
            return False
        self.contributed[position] = True
        self.num_contributed += 1
        return True

    def reset(self) -> None:
        """A new task starts (the bucket, if any, is handled by the reducer)."""
        for position in range(len(self.contributed)):
            self.contributed[position] = False
        self.num_contributed = 0
        self.launched = False


class KeptGradient:
    """The gradient storage of one trainable group: the full group, or this rank's shard."""

    def __init__(
        self, flat: FlatGroup, *, covers_full: bool, dtype: torch.dtype, sync: GradSync
    ) -> None:
        self.flat = flat
        self.covers_full = covers_full
        numel = flat.padded_numel if covers_full else flat.shard_numel
        self.storage = torch.zeros(numel, dtype=dtype, device=flat.device)
        self.sync = sync
        self.task = TaskContribution(len(flat.params))

    def owned(self) -> torch.Tensor:
        """The gradient of the owned range (what the optimizer parameter's `.grad` becomes)."""
        if not self.covers_full:
            return self.storage
        start, end = self.flat.owned_range
        return self.storage[start:end]

    def shard_of_storage(self) -> torch.Tensor:
        """The part of the storage that is this rank's shard (for a reduce-scatter's output)."""
        if not self.covers_full:
            return self.storage
        start, end = self.flat.shard_range
        return self.storage[start:end]
