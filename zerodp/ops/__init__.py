"""DeepSpeed's `deepspeed.ops` optimizers for scripts that build them themselves.

`zerodp.ops.adam.FusedAdam` / `DeepSpeedCPUAdam`, `zerodp.ops.lamb.FusedLamb`,
`zerodp.ops.lion.FusedLion` / `DeepSpeedCPULion` and
`zerodp.ops.adagrad.DeepSpeedCPUAdagrad` take DeepSpeed's constructor arguments
and compute what they mean with torch's optimizers (or zerodp's LAMB and Lion,
which follow DeepSpeed's kernels), or refuse an argument with a message. No
kernel is built. DeepSpeed's other ops (its transformer and sparse-attention
kernels, quantizers, op builders) are not implemented: importing one raises
`zerodp.UnsupportedModuleError` naming what to use instead.

A face over the package: nothing in zerodp imports it.
"""

from __future__ import annotations

from typing import Any

from zerodp.ops import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]


def __getattr__(name: str) -> Any:
    from zerodp.compat.unsupported import missing_attribute

    return missing_attribute(__name__, name)
