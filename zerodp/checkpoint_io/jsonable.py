"""The one JSON codec of checkpoints: plain data in, plain data out, nothing unpickled.

Tuples are kept as tuples (marked), so an optimizer's `betas` comes back as
it went in. Tensors either become numbers (settings such as a scheduler's
`base_lrs`) or, when a tensor sink is given (`client_state`), are stored by
DCP and replaced by a reference.
"""

from __future__ import annotations

from typing import Any

import torch

TENSOR_REF = "__zerodp_tensor__"
TUPLE = "__zerodp_tuple__"


def to_jsonable(value: Any, tensors: dict[str, torch.Tensor] | None = None, path: str = "") -> Any:
    """`value` as JSON-able data; with `tensors`, tensors are moved there and referenced."""
    if isinstance(value, torch.Tensor):
        if tensors is None:
            return value.item() if value.numel() == 1 else value.tolist()
        key = f"client.{len(tensors)}"
        tensors[key] = value.detach()
        return {TENSOR_REF: key}
    if isinstance(value, dict):
        if tensors is not None and not all(isinstance(k, str) for k in value):
            raise TypeError(f"client_state{path}: dict keys must be strings")
        return {str(k): to_jsonable(v, tensors, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, tuple):
        return {TUPLE: [to_jsonable(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_jsonable(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    where = f"client_state{path}" if tensors is not None else "a saved setting"
    raise TypeError(
        f"{where} is a {type(value).__name__}; a checkpoint keeps plain data (dict, list, "
        "tuple, str, int, float, bool, None) and tensors only, so that loading never "
        "unpickles code; convert it first"
    )


def from_jsonable(value: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """The inverse of `to_jsonable` (tensor references are looked up in `tensors`)."""
    if isinstance(value, dict):
        if tensors is not None and set(value) == {TENSOR_REF}:
            return tensors[value[TENSOR_REF]]
        if set(value) == {TUPLE}:
            return tuple(from_jsonable(v, tensors) for v in value[TUPLE])
        return {k: from_jsonable(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [from_jsonable(v, tensors) for v in value]
    return value
