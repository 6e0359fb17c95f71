"""Process-group set-up from the launcher's environment.

`zerodp.initialize` calls `ensure_process_group`, so a script launched by
`torchrun` (or `zerodp run`), `srun` or `mpirun` needs no set-up of its own
(`zerodp.comm.launch_env` reads the last two), and a plain `python script.py`
runs at world size 1 without any environment variables.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from zerodp.comm.faults import teardown
from zerodp.comm.launch_env import adopt_launch_env


class _GroupState:
    """Whether zerodp created the default process group (and so may destroy it)."""

    owned = False


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def current_world_size() -> int:
    """The default process group's size (it must be set up)."""
    return dist.get_world_size()


def current_rank() -> int:
    """This process's rank in the default process group (it must be set up)."""
    return dist.get_rank()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def default_device() -> torch.device:
    """The device this rank trains on: its accelerator when there is one, else the CPU.

    `ZERODP_DEVICE=cpu` forces the CPU (useful for gloo tests on a GPU machine).
    """
    forced = os.environ.get("ZERODP_DEVICE")
    if forced:
        return torch.device(forced)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None:
            count = max(accelerator.device_count(), 1)
            return torch.device(current.type, local_rank() % count)
    return torch.device("cpu")


def _backend_for(device: torch.device) -> str:
    if device.type == "cpu":
        return "gloo"
    # CPU tensors (objects, checkpoint metadata) still travel over gloo.
    accelerator_backend = dist.Backend.default_device_backend_map.get(device.type, "gloo")
    return f"cpu:gloo,{device.type}:{accelerator_backend}"


def default_store() -> Any:
    """The default process group's key-value store: messages between ranks that take no
    part in the group's collectives (torch keeps this accessor private)."""
    return dist.distributed_c10d._get_default_store()


TIMEOUT_ENV = "ZERODP_COMMS_TIMEOUT_S"


def comms_timeout(timeout_s: float | None) -> datetime.timedelta | None:
    """The collective timeout: `timeout_s` (the config's comms_timeout_s), else
    $ZERODP_COMMS_TIMEOUT_S, else None (torch's default for the backend)."""
    if timeout_s is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        if not text:
            return None
        try:
            timeout_s = float(text)
        except ValueError:
            timeout_s = -1.0
        if not timeout_s > 0:
            raise ValueError(
                f"{TIMEOUT_ENV}={text!r}: expected a number of seconds > 0; set it to e.g. 600"
            )
    return datetime.timedelta(seconds=timeout_s)


def ensure_process_group(timeout_s: float | None = None) -> None:
    """Initialise the default process group from the launcher's variables if it is not up
    yet: torchrun's, else those of srun or mpirun, written as torchrun's (`launch_env`).

    Collectives wait at most `timeout_s` (see `comms_timeout`); torch's default for
    the backend when neither it nor the environment variable is set.
    """
    timeout = comms_timeout(timeout_s)
    if is_initialized():
        if timeout_s is not None and not _GroupState.owned:
            warnings.warn(
                f"comms_timeout_s={timeout_s} has no effect: the process group was set up "
                "before zerodp.initialize; pass timeout= to torch.distributed."
                "init_process_group instead",
                stacklevel=3,
            )
        return
    if not dist.is_available():
        raise RuntimeError(
            "torch.distributed is not available in this PyTorch build; "
            "install a build with distributed support"
        )
    launch = adopt_launch_env()  # a partial environment raises here, naming what is missing
    device = default_device()
    if device.type != "cpu":
        accelerator_module = getattr(torch, device.type)
        accelerator_module.set_device(device)
    backend = _backend_for(device)
    if not launch.rendezvous:
        # One process (a plain `python script.py`): no rendezvous needed.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        dist.init_process_group(backend, timeout=timeout)
    _GroupState.owned = True
    teardown.register()  # destroyed at exit: see [Note: ending the process]


def destroy_process_group_if_owned() -> None:
    """Tear down the default group when zerodp created it (scripts call this at exit)."""
    if _GroupState.owned and is_initialized():
        dist.destroy_process_group()
    _GroupState.owned = False
