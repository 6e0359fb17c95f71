"""hpZ's secondary shard of one sharded group: a cached copy, valid until the parameters change.

[Note: hpZ secondary shard]
With `zero_hpz_partition_size` H (see [Note: shard groups] in
`zerodp.comm.topology`) a gather of a stage 3 group from its shard group (the
primary shards, across nodes) leaves each rank a copy of one H-th of the full
buffer: the part at its place in its hpZ group, H consecutive ranks on one
node. While that copy is valid every gather of the group all-gathers the
copies inside the hpZ group instead (a backward's, a later micro-batch's
forward, a recomputation, a `GatheredParameters` block), so only the first
gather after a change crosses nodes.

It is a cache, so it is invalidated whenever the parameters change, on every
rank at the same point: after an optimizer step and after a checkpoint load
(both end in the parameter runtime's `publish_after_step`), when a
`GatheredParameters` block with a modifier rank (where an assigned `.data` is
kept) publishes its values, and when `safe_set_full_fp32_param` writes one.
Each of those is a call every rank makes, so whether the copy is valid (and
so which group the next gather runs in) is the same on every rank of an hpZ
group; the collective order check notes the two kinds of gather apart, so a
rank that disagrees is a `DivergenceError`, not a hang. The copy is taken
from the full buffer right after a gather from the primary shards completes,
before anything can write into it (a write to a gathered parameter outside a
modifier block is dropped at release, and so never reaches the copy).
"""

from __future__ import annotations

import torch

from zerodp.comm import Comm, Handle


class SecondaryShard:
    """This rank's H-th of a sharded group's full buffer, and whether it is current."""

    def __init__(self, padded_numel: int, comm: Comm) -> None:
        if padded_numel % comm.world_size != 0:
            raise RuntimeError(
                f"internal error: {padded_numel} elements do not split into {comm.world_size} "
                "secondary shards"
            )
        self.comm = comm  # the hpZ group
        self.numel = padded_numel // comm.world_size
        self._start = comm.rank * self.numel
        self._copy: torch.Tensor | None = None  # allocated at the first primary gather
        self.valid = False

    def take_from(self, full: torch.Tensor) -> None:
        """Keep this rank's part of a full buffer just gathered from the primary shards."""
        part = full[self._start : self._start + self.numel]
        if self._copy is None:
            self._copy = torch.empty_like(part)
        with torch.no_grad():
            self._copy.copy_(part)
        self.valid = True

    def gather_into(self, full: torch.Tensor) -> Handle:
        """All-gather the hpZ group's copies into `full` (in flight; the copy must be valid)."""
        if not self.valid or self._copy is None:
            raise RuntimeError("internal error: gathering from a stale secondary shard")
        return self.comm.all_gather(full, self._copy, async_op=True)

    def invalidate(self) -> None:
        """The parameters changed: the next gather goes to the primary shards again."""
        self.valid = False

    @property
    def copy(self) -> torch.Tensor | None:
        """The copy's tensor (None before the first gather); `offload_states` moves it."""
        return self._copy

    @property
    def nbytes(self) -> int:
        """Memory the copy holds (kept allocated while stale, to be refilled)."""
        return 0 if self._copy is None else self._copy.numel() * self._copy.element_size()
