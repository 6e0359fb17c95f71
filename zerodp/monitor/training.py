"""What the engine reports at each accumulation boundary, and to which monitor.

The loss passed to `engine.backward` is averaged over the accumulation window
on the device, without synchronising; values are read (`.item()`) only when a
monitor is enabled and only once per boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zerodp.comm import Comm
from zerodp.monitor.events import (
    GRAD_NORM,
    LEARNING_RATE,
    LOSS_SCALE,
    SAMPLES_PER_SEC,
    TRAIN_LOSS,
)
from zerodp.monitor.sinks import Monitor
from zerodp.parallel import ParallelDims


@dataclass(frozen=True)
class BoundaryRecord:
    """What the engine knows at an accumulation boundary, after the optimizer step."""

    global_samples: int  # the x axis of every event (DeepSpeed's "Train/Samples/...")
    lr: float
    loss_scale: float
    grad_norm: float | None
    train_batch_size: int
    extra: list[tuple[str, float, int]] = field(default_factory=list)  # e.g. eigenvalues


class TrainingReporter:
    """Collects the boundary's values on every rank; rank 0's monitor writes them.

    `active` is the same on every rank (a monitor is configured), because the
    train loss is averaged over ranks with a collective every rank must join;
    only rank 0's monitor has sinks. `comm` spans the world; `dims` say what the
    world's sum of the ranks' losses is divided by.
    """

    def __init__(self, monitor: Monitor, active: bool, comm: Comm, dims: ParallelDims) -> None:
        self.monitor = monitor
        self.active = active
        self.comm = comm
        self.dims = dims
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._window_start = time.perf_counter()

    def record_loss(self, loss: torch.Tensor) -> None:
        if not self.active:
            return
        value = loss.detach().float()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def on_boundary(self, make_record: Callable[[], BoundaryRecord]) -> None:
        """Report the window that just ended; `make_record` is called only if a monitor writes.

        (Building the record reads values off the device, which would cost a
        synchronisation on every rank at every step.)
        """
        now = time.perf_counter()
        elapsed = now - self._window_start
        self._window_start = now
        if not self.active:
            return
        mean_loss = None
        if self._loss_sum is not None:
            mean = self._loss_sum.reshape(1) / self._loss_count
            self.comm.all_reduce(mean)  # every rank's loss: what the step optimised
            mean_loss = float(mean.item()) / self.dims.reported_value_divisor()
        self._loss_sum = None
        self._loss_count = 0
        if not self.monitor.enabled:
            return
        record = make_record()
        step = record.global_samples
        events: list[tuple[str, float, int]] = [
            (LEARNING_RATE, record.lr, step),
            (LOSS_SCALE, record.loss_scale, step),
        ]
        if mean_loss is not None:
            events.append((TRAIN_LOSS, mean_loss, step))
        if record.grad_norm is not None:
            events.append((GRAD_NORM, record.grad_norm, step))
        if elapsed > 0:
            events.append((SAMPLES_PER_SEC, record.train_batch_size / elapsed, step))
        self.monitor.write_events(events + record.extra)

    def close(self) -> None:
        self.monitor.close()
