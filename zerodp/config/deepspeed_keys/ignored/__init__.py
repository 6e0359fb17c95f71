"""DeepSpeed keys that change nothing in zerodp: accepted, type-checked, then dropped.

Each entry says why the key has no effect here. Most of them configure
something zerodp always does one way (it always reduce-scatters, always
keeps fp32 masters) or a DeepSpeed subsystem zerodp has no counterpart for
(timers, profilers). `same` says which values ask for what zerodp does
anyway; any other value gets `differs` in the warning, so a config that asks
for behaviour zerodp lacks says so instead of passing silently.

The table is split by where the keys are in the config: `top_level`,
`optimizer_and_precision`, `zero_optimization` (with `aio`) and `features`
(`checkpoint`, `eigenvalue`, `compile`); `entry` is the record each row is.
Warnings list the keys in this order.
"""

from __future__ import annotations

from zerodp.config.deepspeed_keys.ignored.entry import Ignored
from zerodp.config.deepspeed_keys.ignored.features import FEATURES
from zerodp.config.deepspeed_keys.ignored.optimizer_and_precision import OPTIMIZER_AND_PRECISION
from zerodp.config.deepspeed_keys.ignored.top_level import TOP_LEVEL
from zerodp.config.deepspeed_keys.ignored.zero_optimization import ZERO_OPTIMIZATION

__all__ = ["IGNORED", "Ignored"]

IGNORED: tuple[Ignored, ...] = (
    *TOP_LEVEL,
    *OPTIMIZER_AND_PRECISION,
    *ZERO_OPTIMIZATION,
    *FEATURES,
)
