"""The one builder of zerodp config dicts for the tests (DeepSpeed-style keys).

Each test states what it depends on (stage, batch, optimizer, precision, ...) as keyword
arguments; a key the test does not state is left out of the dict, so the engine's default
applies and the dict reads like the config a user would write. Keys the builder owns cannot
be passed again as extra top-level keys, so no argument silently overrides another. Every
value is copied, so module-level constants can be shared by many configs safely.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

DTYPES = ("fp32", "bf16", "fp16")
_OWNED_KEYS = {
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "gradient_clipping",
    "zero_optimization",
    "bf16",
    "fp16",
}


def optimizer_config(kind: str, **params: Any) -> dict[str, Any]:
    """The "optimizer" entry: optimizer_config("AdamW", lr=1e-2) is
    {"type": "AdamW", "params": {"lr": 1e-2}}."""
    return {"type": kind, "params": params}


def zerodp_config(
    stage: int,
    *,
    micro_batch: int | None = 4,
    gas: int | None = None,
    optimizer: Mapping[str, Any] | None = None,
    dtype: str = "fp32",
    loss_scale_power: int | None = None,
    fp16: Mapping[str, Any] | None = None,
    persistence_threshold: int | None = None,
    clipping: float | None = 0.0,
    zero: Mapping[str, Any] | None = None,
    **top_level: Any,
) -> dict[str, Any]:
    """A config dict for `zerodp.initialize` / `zero.Init`; an argument left None is left out.

    stage:                 zero_optimization.stage
    micro_batch:           train_micro_batch_size_per_gpu (None when train_batch_size= is given)
    gas:                   gradient_accumulation_steps
    optimizer:             the "optimizer" entry (`optimizer_config`); None for a user's own
    dtype:                 "fp32", "bf16" (bf16.enabled) or "fp16" (fp16.enabled)
    loss_scale_power:      fp16.initial_scale_power
    fp16:                  further fp16 keys (hysteresis, min_loss_scale, ...)
    persistence_threshold: zero_optimization.stage3_param_persistence_threshold
    clipping:              gradient_clipping, always written: 0 (off) unless given (None
                           is 0 too, as it was when 0 was the engine's default). The
                           references the tests compare with do not clip; the engine's own
                           default when the key is left out (DeepSpeed's 1.0) is tested in
                           tests/unit/test_deepspeed_defaults.py and test_deepspeed_script.py
    zero:                  further zero_optimization keys (buckets, prefetch, ...)
    top_level:             further top-level keys (scheduler, seed, monitors, ...)
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype != "fp16" and (loss_scale_power is not None or fp16):
        raise ValueError("loss_scale_power and fp16 options need dtype='fp16'")
    owned = _OWNED_KEYS & set(top_level)
    if owned:
        raise ValueError(f"pass {sorted(owned)} through the builder's own arguments")
    optimizer, fp16, zero, top_level = copy.deepcopy((optimizer, fp16, zero, top_level))
    config: dict[str, Any] = {}
    if micro_batch is not None:
        config["train_micro_batch_size_per_gpu"] = micro_batch
    if gas is not None:
        config["gradient_accumulation_steps"] = gas
    if optimizer is not None:
        config["optimizer"] = dict(optimizer)
    config["gradient_clipping"] = clipping or 0.0
    zero_optimization: dict[str, Any] = {"stage": stage}
    if persistence_threshold is not None:
        zero_optimization["stage3_param_persistence_threshold"] = persistence_threshold
    zero_optimization.update(zero or {})
    config["zero_optimization"] = zero_optimization
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        fp16_entry: dict[str, Any] = {"enabled": True}
        if loss_scale_power is not None:
            fp16_entry["initial_scale_power"] = loss_scale_power
        fp16_entry.update(fp16 or {})
        config["fp16"] = fp16_entry
    config.update(top_level)
    return config
