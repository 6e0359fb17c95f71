"""DeepSpeed's `deepspeed.accelerator` for scripts: `get_accelerator()`.

A script written for DeepSpeed asks the accelerator for its device name,
current device, communication backend, bf16/fp16 support, memory statistics
and random generator (`from zerodp.accelerator import get_accelerator`). The
answers are for the device zerodp trains on (`zerodp.comm.default_device()`:
the local accelerator, or the CPU; `ZERODP_DEVICE` chooses), as DeepSpeed's
CPU and CUDA accelerators give them.

DeepSpeed picks its accelerator from `DS_ACCELERATOR`; zerodp's device comes
from `ZERODP_DEVICE`. When `DS_ACCELERATOR` names another device than the one
zerodp trains on, `get_accelerator()` raises instead of answering for a device
the engine does not use. A face over the package: nothing in zerodp imports it.
"""

from __future__ import annotations

import os

from zerodp.accelerator.devices import CpuAccelerator, DeviceAccelerator
from zerodp.comm import backend_name, default_device
from zerodp.errors import UsageError

__all__ = [
    "CpuAccelerator",
    "DeviceAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
]

_accelerators: dict[str, CpuAccelerator | DeviceAccelerator] = {}


def get_accelerator() -> CpuAccelerator | DeviceAccelerator:
    """The accelerator of the device zerodp trains on (one object per device type)."""
    device_type = default_device().type
    wanted = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if wanted and wanted != device_type:
        raise UsageError(
            f"DS_ACCELERATOR={wanted} but zerodp trains on {device_type}: zerodp chooses its "
            f"device from ZERODP_DEVICE; set ZERODP_DEVICE={wanted} (or unset DS_ACCELERATOR)"
        )
    if device_type not in _accelerators:
        if device_type == "cpu":
            _accelerators[device_type] = CpuAccelerator()
        else:
            _accelerators[device_type] = DeviceAccelerator(device_type, backend_name())
    return _accelerators[device_type]


def is_current_accelerator_supported() -> bool:
    return True
