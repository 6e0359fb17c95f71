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
    """The gradient storage of one trainable group: the full group, or this rank's shard.

    A zero kept gradient may hold no memory (`release_when_zero`): between the step and the
    next backward a gradient is zero, and the memory of every group's shard is then
    free for the next forward's activations, as a `.grad` set to None is. The first
    reader of `storage` brings it back, zeroed (the same tensor, so its views stay
    valid); the reducer writes a group's shard only when its reduction is in, so the
    shards come back one group at a time as the backward frees the activations.
    """

    def __init__(
        self,
        flat: FlatGroup,
        *,
        covers_full: bool,
        dtype: torch.dtype,
        sync: GradSync,
        release_when_zero: bool = False,
    ) -> None:
        self.flat = flat
        self.covers_full = covers_full
        numel = flat.padded_numel if covers_full else flat.shard_numel
        self._data = torch.zeros(numel, dtype=dtype, device=flat.device)
        self._nbytes = self._data.untyped_storage().nbytes()
        self._released = False
        # False while `param.grad` shows views of the storage (stage 0's
        # `zerodp.backward.param_grad_views`).
        self.release_when_zero = release_when_zero
        self.sync = sync
        self.task = TaskContribution(len(flat.params))
        self.zero()

    @property
    def storage(self) -> torch.Tensor:
        """The kept gradient's flat tensor (brought back, zeroed, if it was released)."""
        if self._released:
            self._data.untyped_storage().resize_(self._nbytes)
            self._data.zero_()
            self._released = False
        return self._data

    @property
    def released(self) -> bool:
        """Whether the gradient is zero and holds no memory (see `zero`)."""
        return self._released

    def zero(self) -> None:
        """Zero the gradient: release its memory if it may be, else write zeros."""
        if not self.release_when_zero:
            self._data.zero_()
        elif not self._released and self._data.numel():
            self._data.untyped_storage().resize_(0)
            self._released = True

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
