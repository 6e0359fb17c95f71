"""Build `AutoHints` from what `zerodp.initialize` was given.

Kept apart from `auto.py` so that resolving "auto" stays a pure function of
a dict and a record: this module is the only one in the config package that
looks at torch objects, and it only reads them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from zerodp.config.auto import AutoHints

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_HIDDEN_ATTRS = ("hidden_size", "d_model", "n_embd")


def hints_from_arguments(
    *,
    model: Any,
    optimizer: Any,
    lr_scheduler: Any,
    training_data: Any,
    world_size: int,
) -> AutoHints:
    return AutoHints(
        world_size=world_size,
        micro_batch_size=micro_batch_size_of(training_data),
        hidden_size=hidden_size_of(model),
        optimizer_given=optimizer is not None,
        optimizer_settings=optimizer_settings_of(optimizer),
        lr_scheduler_given=lr_scheduler is not None,
        model_dtype=dtype_of(model),
    )


def micro_batch_size_of(training_data: Any) -> int | None:
    """A DataLoader's batch_size (None for a dataset, or a loader with a batch sampler)."""
    if isinstance(training_data, torch.utils.data.DataLoader):
        size = training_data.batch_size
        return size if isinstance(size, int) and size > 0 else None
    return None


def hidden_size_of(model: Any) -> int | None:
    """HF's rule (the model config's hidden size), else the widest nn.Linear's input."""
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if source is None:
            continue
        for attr in _HIDDEN_ATTRS:
            value = getattr(source, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        sizes = getattr(source, "hidden_sizes", None)
        if isinstance(sizes, list | tuple) and sizes and all(isinstance(s, int) for s in sizes):
            return max(sizes)
    if isinstance(model, nn.Module):
        widths = [m.in_features for m in model.modules() if isinstance(m, nn.Linear)]
        if widths:
            return max(widths)
    return None


def optimizer_settings_of(optimizer: Any) -> Mapping[str, Any] | None:
    """A torch optimizer's constructor settings as JSON values (lists for tuples)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    out: dict[str, Any] = {}
    for key, value in optimizer.defaults.items():
        plain = _json_value(value)
        if plain is not None:
            out[key] = plain
    return out


def _json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, bool | int | float):
        return value
    if isinstance(value, tuple | list):
        items = [_json_value(v) for v in value]
        return None if any(i is None for i in items) else items
    return None


def dtype_of(model: Any) -> str | None:
    """The dtype holding most of the model's floating-point parameter elements."""
    if not isinstance(model, nn.Module):
        return None
    counts: Counter[torch.dtype] = Counter()
    for param in model.parameters():
        if param.is_floating_point():
            counts[param.dtype] += param.numel()
    if not counts:
        return None
    dtype = counts.most_common(1)[0][0]
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
