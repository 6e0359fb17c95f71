"""What the engine reports at each accumulation boundary, and to which monitor.

The loss passed to `engine.backward` is averaged over the accumulation window
on the device, without synchronising; values are read (`.item()`) only when a
monitor is enabled and only once per boundary.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from zerodp.monitor.events import (
    GRAD_NORM,
    LEARNING_RATE,
    LOSS_SCALE,
    SAMPLES_PER_SEC,
    TRAIN_LOSS,
)
from zerodp.monitor.sinks import Monitor

if TYPE_CHECKING:
    from zerodp.engine import ZeroEngine


class TrainingReporter:
    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._window_start = time.perf_counter()

    @property
    def enabled(self) -> bool:
        return self.monitor.enabled

    def record_loss(self, loss: torch.Tensor) -> None:
        if not self.enabled:
            return
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def on_boundary(self, engine: ZeroEngine, extra: list[tuple[str, float, int]]) -> None:
        now = time.perf_counter()
        elapsed = now - self._window_start
        self._window_start = now
        if not self.enabled:
            return
        step = engine.global_samples
        events: list[tuple[str, float, int]] = [
            (LEARNING_RATE, engine.get_lr()[0], step),
            (LOSS_SCALE, engine.loss_scale, step),
        ]
        if self._loss_sum is not None:
            events.append((TRAIN_LOSS, float(self._loss_sum.item()) / self._loss_count, step))
        norm = engine.get_global_grad_norm()
        if norm is not None:
            events.append((GRAD_NORM, norm, step))
        if elapsed > 0:
            events.append((SAMPLES_PER_SEC, engine.train_batch_size() / elapsed, step))
        self.monitor.write_events(events + extra)
        self._loss_sum = None
        self._loss_count = 0

    def close(self) -> None:
        self.monitor.close()
