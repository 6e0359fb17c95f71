"""A DCP save planner whose data is a copy in host memory, taken at the call.

A decoupled save writes while training goes on and changes the engine's
tensors, so what it writes must be a copy taken when `save_checkpoint` was
called. `HostStagedPlanner` plans on the live state dict (planning reads only
shapes and placements), then `stage` copies the data of the items this rank
writes, and nothing else: DCP writes each replicated tensor from one rank only,
so no rank copies what another writes. From then on it answers DCP's writer
from the copies and holds no reference to the engine's tensors.

One copy per item, into memory of exactly its size (`HostBuffers`, kept for
the next save): a tensor on an accelerator goes to pinned (page-locked) host
memory, copied without blocking and waited for once at the end; a tensor
already in host memory is copied once. The host holds one copy of this rank's
share of the checkpoint, from the first decoupled save on.
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem


class HostBuffers:
    """The host memory a decoupled writer copies into, kept from one save to the next.

    The next save copies into the same buffers (an item of the same shape and dtype
    gets its buffer back), so a run that saves often allocates, and pays the page
    faults or the pinning, once; the buffers an item no longer needs are dropped.
    Only one save is ever in flight (the next waits for it), so a buffer is never
    written while the thread still reads it.
    """

    def __init__(self) -> None:
        self._kept: dict[MetadataIndex, tuple[torch.Tensor, bool]] = {}
        self._used: dict[MetadataIndex, tuple[torch.Tensor, bool]] = {}

    def copy_of(self, index: MetadataIndex, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(a contiguous host copy of `tensor`, whether it is pinned and still being copied)."""
        source = tensor.detach()
        pinned = source.device.type != "cpu"
        kept = self._kept.get(index)
        if kept is None or kept[1] != pinned or not _fits(kept[0], source):
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pinned)
        else:
            buffer = kept[0]
        buffer.copy_(source, non_blocking=pinned)
        self._used[index] = (buffer, pinned)
        return buffer, pinned

    def begin(self) -> None:
        """A new save's copies start (what an unfinished one used is not kept)."""
        self._used = {}

    def keep_used(self) -> None:
        """Keep the buffers this save used (and no other) for the next one."""
        self._kept, self._used = self._used, {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self._kept.values())


def _fits(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    return buffer.shape == source.shape and buffer.dtype == source.dtype


class HostStagedPlanner(DefaultSavePlanner):
    """DCP's default save planner, resolving data from host copies once `stage` has run."""

    def __init__(self, buffers: HostBuffers) -> None:
        super().__init__()
        self._buffers = buffers
        self._staged: dict[MetadataIndex, torch.Tensor | io.BytesIO] | None = None
        self.staged_bytes = 0

    def stage(self, plan: SavePlan) -> None:
        """Copy the data of every item of `plan` (this rank's final plan) to host memory."""
        staged: dict[MetadataIndex, torch.Tensor | io.BytesIO] = {}
        waits = False
        self._buffers.begin()
        for item in plan.items:
            data = super().resolve_data(item)
            if isinstance(data, torch.Tensor):
                copy, pinned = self._buffers.copy_of(item.index, data)
                waits = waits or pinned
                self.staged_bytes += copy.numel() * copy.element_size()
                staged[item.index] = copy
            else:  # a non-tensor value, already serialized into a new buffer
                staged[item.index] = data
                self.staged_bytes += data.getbuffer().nbytes
        if waits:
            torch.accelerator.synchronize()  # the copies were issued without blocking
        self._buffers.keep_used()
        self._staged = staged
        self.state_dict = {}  # the engine's tensors: no longer needed, not held

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if self._staged is None:
            raise RuntimeError("internal error: a staged save resolved data before staging")
        return self._staged[write_item.index]
