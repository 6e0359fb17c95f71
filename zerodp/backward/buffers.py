"""Flat buffers reused within one backward, and let go once its reductions are done."""

from __future__ import annotations

from collections import defaultdict

import torch


class BufferPool:
    """Hands out 1-D buffers by (numel, dtype, device) and takes them back for reuse.

    Within one backward, buckets of the same few sizes are taken and given back as
    reductions complete, so reuse saves an allocation per group. Between backwards
    they are dead weight through the optimizer step and the next forward (when a
    stage 2 bucket of `reduce_bucket_size` elements is most in the way), so the owner
    calls `release_idle` at the end of each backward. Re-making them is nearly free
    for an accelerator's caching allocator and glibc's heap; only big blocks served
    by mmap pay page faults, about 1% of a CPU step (bench/README.md, memory cap).

    `allocated_numel` is the most elements held at once (out plus idle), a high-water
    mark kept across releases; `held_numel` is what is held now.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(
            list
        )
        self.held_numel = 0
        self.allocated_numel = 0

    @property
    def idle_numel(self) -> int:
        """Elements of the buffers given back and kept for reuse."""
        return sum(key[0] * len(free) for key, free in self._free.items())

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free[(numel, dtype, device)]
        if free:
            return free.pop()
        # A new buffer: idle ones of other sizes would sit beside it until the backward's
        # end (groups of a few sizes take turns), so they go first; the most held at once
        # is then what is out plus the idle buffers of one size.
        self.release_idle()
        self.held_numel += numel
        self.allocated_numel = max(self.allocated_numel, self.held_numel)
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free[(buffer.numel(), buffer.dtype, buffer.device)].append(buffer)

    def release_idle(self) -> None:
        """Drop every buffer given back; buffers still out stay the taker's."""
        self.held_numel -= self.idle_numel
        self._free.clear()
