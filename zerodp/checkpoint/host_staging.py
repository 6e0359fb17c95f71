"""A DCP save planner whose data is a copy in host memory, taken at the call.

A decoupled save writes while training goes on and changes the engine's
tensors, so what it writes must be a copy taken when `save_checkpoint` was
called. `HostStagedPlanner` plans on the live state dict (planning reads only
shapes and placements), then `stage` copies the data of the items this rank
writes, and nothing else: DCP writes each replicated tensor from one rank only,
so no rank copies what another writes. From then on it answers DCP's writer
from the copies and holds no reference to the engine's tensors.

One copy per item, into memory of exactly its size: a tensor on an accelerator
goes to pinned (page-locked) host memory, copied without blocking and waited
for once at the end; a tensor already in host memory is copied once. torch's
pinned-memory allocator keeps freed pinned blocks for the next save (it is a
caching allocator), so a run that saves often pays the pinning once.
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem


class HostStagedPlanner(DefaultSavePlanner):
    """DCP's default save planner, resolving data from host copies once `stage` has run."""

    def __init__(self) -> None:
        super().__init__()
        self._staged: dict[MetadataIndex, torch.Tensor | io.BytesIO] | None = None
        self.staged_bytes = 0

    def stage(self, plan: SavePlan) -> None:
        """Copy the data of every item of `plan` (this rank's final plan) to host memory."""
        staged: dict[MetadataIndex, torch.Tensor | io.BytesIO] = {}
        waits = False
        for item in plan.items:
            data = super().resolve_data(item)
            if isinstance(data, torch.Tensor):
                copy, pinned = host_copy(data)
                waits = waits or pinned
                self.staged_bytes += copy.numel() * copy.element_size()
                staged[item.index] = copy
            else:  # a non-tensor value, already serialized into a new buffer
                staged[item.index] = data
                self.staged_bytes += data.getbuffer().nbytes
        if waits:
            torch.accelerator.synchronize()  # the copies were issued without blocking
        self._staged = staged
        self.state_dict = {}  # the engine's tensors: no longer needed, not held

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if self._staged is None:
            raise RuntimeError("internal error: a staged save resolved data before staging")
        return self._staged[write_item.index]


def host_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(a contiguous host copy of `tensor`, whether it is pinned and still being copied)."""
    source = tensor.detach()
    if source.device.type == "cpu":
        return source.clone(memory_format=torch.contiguous_format), False
    copy = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    copy.copy_(source, non_blocking=True)
    return copy, True
