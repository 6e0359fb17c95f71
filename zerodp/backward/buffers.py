"""Reusable flat buffers, so that backward does not allocate full-size tensors every step."""

from __future__ import annotations

from collections import defaultdict

import torch


class BufferPool:
    """Hands out 1-D buffers by (numel, dtype, device) and takes them back for reuse."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(
            list
        )

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free[(numel, dtype, device)]
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free[(buffer.numel(), buffer.dtype, buffer.device)].append(buffer)
