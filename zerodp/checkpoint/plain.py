"""The non-tensor part of a checkpoint, as JSON: nothing is ever unpickled from it.

`zerodp_state.json` (written by rank 0) holds what every rank shares:
counters, the optimizer's param-group settings, the LR scheduler, the loss
scaler, the data loader's position, a description of the model (names,
shapes, dtypes, state-dict keys, tied names) and the user's `client_state`.
`rank<r>.json` holds each rank's Python and NumPy random states. Tensors in
`client_state` are stored by DCP under `client.<n>` and replaced in the JSON
by a reference.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zerodp.errors import CheckpointError

if TYPE_CHECKING:
    from zerodp.engine import ZeroEngine

STATE_FILE = "zerodp_state.json"
FORMAT = "zerodp-checkpoint"
FORMAT_VERSION = 1
_TENSOR_REF = "__zerodp_tensor__"
_TUPLE = "__zerodp_tuple__"


def encode_client_state(client_state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split `client_state` into JSON-able data and tensors (stored by DCP)."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = f"client.{len(tensors)}"
            tensors[key] = value.detach()
            return {_TENSOR_REF: key}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"client_state{path}: dict keys must be strings")
            return {k: encode(v, f"{path}[{k!r}]") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return {_TUPLE: items} if isinstance(value, tuple) else items
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else repr(value)
        raise TypeError(
            f"client_state{path} is a {type(value).__name__}; a checkpoint keeps plain data "
            "(dict, list, tuple, str, int, float, bool, None) and tensors only, so that "
            "loading never unpickles code; convert it first"
        )

    return encode(client_state, ""), tensors


def decode_client_state(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(data, dict):
        if set(data) == {_TENSOR_REF}:
            return tensors[data[_TENSOR_REF]]
        if set(data) == {_TUPLE}:
            return tuple(decode_client_state(v, tensors) for v in data[_TUPLE])
        return {k: decode_client_state(v, tensors) for k, v in data.items()}
    if isinstance(data, list):
        return [decode_client_state(v, tensors) for v in data]
    return data


def _jsonable(value: Any) -> Any:
    """Scheduler/optimizer settings to JSON (tensors become numbers, tuples are marked)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {_TUPLE: [_jsonable(v) for v in value]}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint")


def _from_jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_from_jsonable(v) for v in value[_TUPLE])
        return {k: _from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_jsonable(v) for v in value]
    return value


def shared_state(engine: ZeroEngine, client_json: Any) -> dict[str, Any]:
    module = engine.module
    params = {
        name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
        for name, p in module.named_parameters()
    }
    first_name = {id(p): name for name, p in module.named_parameters()}
    aliases = {
        name: first_name[id(p)]
        for name, p in module.named_parameters(remove_duplicate=False)
        if first_name[id(p)] != name
    }
    groups = [
        _jsonable({k: v for k, v in group.items() if k != "params"})
        for group in engine.optimizer.param_groups
    ]
    scheduler = engine.lr_scheduler
    loader = engine.training_dataloader
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "zero_stage": engine.zero_stage,
        "world_size": engine.world_size,
        "param_dtype": str(engine.precision.param_dtype).removeprefix("torch."),
        "params": params,
        "tied": aliases,
        "buffers": {name: list(b.shape) for name, b in module.named_buffers()},
        "state_dict_keys": list(module.state_dict(keep_vars=True).keys()),
        "counters": {
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.optimizer.skipped_steps,
        },
        "optimizer": {"class": type(engine.optimizer.inner).__name__, "param_groups": groups},
        "lr_scheduler": _jsonable(scheduler.state_dict()) if scheduler is not None else None,
        "loss_scaler": engine.optimizer.loss_scaler.state_dict(),
        "dataloader": loader.state_dict() if loader is not None else None,
        "client_state": client_json,
    }


def rank_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python_random": _jsonable(random.getstate())}
    try:
        import numpy as np

        kind, keys, position, has_gauss, cached = np.random.get_state()
        state["numpy_random"] = [kind, np.asarray(keys).tolist(), position, has_gauss, cached]
    except ImportError:
        state["numpy_random"] = None
    return state


def restore_rank_state(state: dict[str, Any]) -> None:
    random.setstate(_from_jsonable(state["python_random"]))
    if state.get("numpy_random") is not None:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, position, has_gauss, cached = state["numpy_random"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached))


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, allow_nan=True))


def read_shared_state(path: Path) -> dict[str, Any]:
    file = path / STATE_FILE
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"'{path}' is not a zerodp checkpoint ({STATE_FILE} is missing): it was not "
            "written by zerodp, or its save did not finish"
        ) from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"'{file}' is unreadable or corrupted: {error}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"'{file}' is not a zerodp checkpoint state file")
    if data.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"'{path}' was written by a newer zerodp (format {data['format_version']}); "
            "upgrade zerodp to load it"
        )
    return data


def apply_optimizer_settings(engine: ZeroEngine, groups: list[dict[str, Any]]) -> None:
    current = engine.optimizer.param_groups
    if len(groups) != len(current):
        raise CheckpointError(
            f"the checkpoint has {len(groups)} optimizer param groups, the engine "
            f"{len(current)}; build the optimizer with the same param groups"
        )
    for group, saved in zip(current, groups, strict=True):
        for key, value in saved.items():
            group[key] = _from_jsonable(value)


def apply_scheduler_state(engine: ZeroEngine, state: Any) -> None:
    if engine.lr_scheduler is not None and state is not None:
        engine.lr_scheduler.load_state_dict(_from_jsonable(state))
