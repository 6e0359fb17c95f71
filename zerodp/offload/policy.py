"""Where the optimizer side and the stage 3 shards live: decided once, from the config."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from zerodp.config.model import ZeroOptimizationConfig

logger = logging.getLogger("zerodp")


class Placement(enum.Enum):
    """Where a tensor zerodp holds lives.

    DEVICE: the accelerator (or, on a CPU-only machine, the CPU) the model trains on.
    HOST: host memory, separate from the device's (pinned when there is an accelerator).
    FILE: a file under `nvme_path`, paged in and out by the operating system.
    """

    DEVICE = "device"
    HOST = "host"
    FILE = "file"


_PLACEMENT = {"none": Placement.DEVICE, "cpu": Placement.HOST, "nvme": Placement.FILE}


@dataclass(frozen=True)
class OffloadPolicy:
    """What is offloaded, where, and how (see docs/offload.md)."""

    optimizer: Placement  # each rank's optimizer copy (fp32 master) and optimizer state
    params: Placement  # each rank's stage 3 parameter shards
    ratio: float  # the fraction of the optimizer's elements offloaded (the rest stays)
    pin_memory: bool  # host buffers are pinned (only with an accelerator)
    optimizer_path: Path | None
    params_path: Path | None

    @classmethod
    def from_config(cls, zero: ZeroOptimizationConfig, device: torch.device) -> OffloadPolicy:
        optimizer, params = zero.offload_optimizer, zero.offload_param
        opt_place = _PLACEMENT[optimizer.device] if optimizer is not None else Placement.DEVICE
        par_place = _PLACEMENT[params.device] if params is not None else Placement.DEVICE
        wants_pin = any(
            s is not None and s.device != "none" and s.pin_memory for s in (optimizer, params)
        )
        pin = wants_pin and device.type != "cpu"
        if wants_pin and not pin:
            logger.info(
                "offload pin_memory is ignored: there is no accelerator (host and device "
                "memory are the same here)"
            )
        return cls(
            optimizer=opt_place,
            params=par_place,
            ratio=optimizer.ratio if optimizer is not None else 1.0,
            pin_memory=pin,
            optimizer_path=_path(optimizer.nvme_path if optimizer is not None else None),
            params_path=_path(params.nvme_path if params is not None else None),
        )

    @property
    def offloads_optimizer(self) -> bool:
        return self.optimizer is not Placement.DEVICE

    @property
    def offloads_params(self) -> bool:
        return self.params is not Placement.DEVICE


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)
