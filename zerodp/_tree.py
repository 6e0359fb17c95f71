"""Finding the tensors inside nested forward inputs and outputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def tensors_in(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every tensor in `obj`: tensors, and lists, tuples, dicts and dataclasses of them."""
    found: list[torch.Tensor] = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            tensors_in(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            tensors_in(item, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            tensors_in(getattr(obj, f.name), found)
    return found


def grad_tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in `obj` that autograd will send a gradient to."""
    return [t for t in tensors_in(obj) if t.requires_grad]
