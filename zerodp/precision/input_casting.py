"""Cast a mixed-precision model's floating-point inputs to its dtype.

The model's parameters are in half precision; a float32 batch fed to its
first layer would fail (or silently upcast), so the root module's
floating-point inputs are cast on the way in. Integer inputs (token ids) pass
through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        return tuple(_cast(item, dtype) for item in obj)
    if isinstance(obj, list):
        return [_cast(item, dtype) for item in obj]
    if isinstance(obj, dict):
        return {key: _cast(value, dtype) for key, value in obj.items()}
    return obj


def install_input_cast(module: nn.Module, dtype: torch.dtype) -> RemovableHandle:
    def cast_inputs(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return _cast(args, dtype), _cast(kwargs, dtype)

    return module.register_forward_pre_hook(cast_inputs, with_kwargs=True)
