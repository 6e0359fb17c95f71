"""`zero_optimization.offload_param` and `offload_optimizer` (DeepSpeed's keys and defaults).

`device` is honoured ("none", "cpu", or "nvme" with `nvme_path`), and so are
`pin_memory` (with an accelerator) and `ratio` (partial optimizer offload).
The other keys tune DeepSpeed's own offload machinery; they are validated
and have no effect here (see docs/offload.md and docs/configuration.md).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from zerodp.config.fields import Bool, Fraction, OptStr, Section, choice

OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], choice(("none", "cpu", "nvme"))]


class OffloadConfig(Section):
    """What both offload sections share (the keys zerodp honours; see docs/offload.md)."""

    device: OffloadDevice = Field("none", description="'none', 'cpu' or 'nvme' (with nvme_path)")
    nvme_path: OptStr = None
    pin_memory: Bool = True  # DeepSpeed's current default; honoured with an accelerator


class OffloadParamConfig(OffloadConfig):
    """`offload_param`: each rank's stage 3 parameter shards on the host or in files."""


class OffloadOptimizerConfig(OffloadConfig):
    """`offload_optimizer`: each rank's optimizer copy and state, and its step, on the host."""

    ratio: Fraction = 1.0  # the fraction of the optimizer's elements offloaded
