"""`zero_optimization.offload_param` and `offload_optimizer`: typed now, built later.

zerodp keeps parameters, gradients and optimizer state on the accelerator.
The sections are validated in full (DeepSpeed's keys, types and defaults) so
that a config written for DeepSpeed loads with `"device": "none"`, and so the
offload work has its schema ready. Asking for `"cpu"` or `"nvme"` is reported
as not implemented yet by `zerodp.config.compat` (one message together with
any other unimplemented feature), not here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from zerodp.config.fields import Bool, Fraction, NonNegInt, OptStr, Section, choice

OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], choice(("none", "cpu", "nvme"))]


class OffloadConfig(Section):
    """What both offload sections share."""

    device: OffloadDevice = Field(
        "none", description="'none', 'cpu' or 'nvme' (zerodp implements 'none' only, so far)"
    )
    nvme_path: OptStr = None
    pin_memory: Bool = True  # DeepSpeed's current default
    buffer_count: NonNegInt = 4


class OffloadParamConfig(OffloadConfig):
    """`offload_param`: parameters to CPU or NVMe (DeepSpeed: stage 3 only)."""

    buffer_count: NonNegInt = 5
    buffer_size: NonNegInt = 100_000_000
    max_in_cpu: NonNegInt = 1_000_000_000


class OffloadOptimizerConfig(OffloadConfig):
    """`offload_optimizer`: optimizer state (and its step) to CPU or NVMe."""

    ratio: Fraction = 1.0
    fast_init: Bool = False
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    pipeline: Bool = False  # DeepSpeed's older name for pipeline_read and pipeline_write
    super_offload: Bool = False
    convert_grad_on_cpu: Bool = True
    cpuadam_cores_perc: Fraction = 0.8
