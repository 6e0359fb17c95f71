"""Reusable flat buffers, so that backward does not allocate full-size tensors every step."""

from __future__ import annotations

from collections import defaultdict

import torch


class BufferPool:
    """Hands out 1-D buffers by (numel, dtype, device) and takes them back for reuse.

    Buffers are kept once made, so `allocated_numel` (every element it ever made) is also
    the most it has held at once: how many full-size gradient buckets a backward needed
    out together.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(
            list
        )
        self.allocated_numel = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free[(numel, dtype, device)]
        if free:
            return free.pop()
        self.allocated_numel += numel
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free[(buffer.numel(), buffer.dtype, buffer.device)].append(buffer)
