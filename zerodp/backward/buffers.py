"""Flat buffers reused within one backward, and let go once its reductions are done."""

from __future__ import annotations

from collections import defaultdict

import torch


class BufferPool:
    """Hands out 1-D buffers by (numel, dtype, device) and takes them back for reuse.

    Within one backward many full-size gradient buckets of the same few sizes are
    taken and given back as reductions complete, so reuse saves an allocation per
    group. Between backwards the buffers are dead weight through the optimizer step
    and the next forward, so the owner calls `release_idle` once no reduction can
    need them (the end of each backward), and the memory goes back to the allocator
    for the step's and the forward's own tensors. Why every backward and not once per
    accumulation window: the next micro-batch's forward is exactly when they would be
    in the way. Why not a bound on what is kept: the cost of re-making them is small
    where it exists at all. An accelerator's caching allocator hands the same blocks
    back; glibc's default malloc serves a size freed once from its heap; only where
    big blocks go back to the system (a fixed mmap threshold) does each backward pay
    page faults: about 1% of a CPU step, from their measured cost per MiB (bench/README.md,
    memory cap; too small for the step-time bench to show).
    Since buckets are reduced in the order gradients complete, a backward holds only a
    few at once, so this is a small saving (15 MiB on the memory-cap GPT at stage 3),
    and it does not lower the peak, which lies inside the backward.

    `allocated_numel` is the most elements held at once (buffers out plus idle):
    how many full-size gradient buckets a backward needed out together. It is a
    high-water mark kept across releases; `held_numel` is what is held now.
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
        self.held_numel += numel
        self.allocated_numel = max(self.allocated_numel, self.held_numel)
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free[(buffer.numel(), buffer.dtype, buffer.device)].append(buffer)

    def release_idle(self) -> None:
        """Drop every buffer given back; buffers still out stay the taker's."""
        self.held_numel -= self.idle_numel
        self._free.clear()
