"""What each JSON value of a checkpoint must look like, checked before anything is loaded.

`zerodp_state.json` and `rank<r>.json` are data, never code, but a damaged
or hand-edited value (`"lr": "abc"`, a missing `counters`) must be an error
naming the key before any tensor or counter changes, not a crash at the
next step. Values that mirror a live object (optimizer settings, scheduler,
data loader) are compared with that object's own state: same keys, same
lengths, compatible leaf types.
"""

from __future__ import annotations

import math
import random
from typing import Any

from zerodp.checkpoint_io.jsonable import from_jsonable, to_jsonable
from zerodp.errors import CheckpointError

_DAMAGED = "the checkpoint's zerodp_state.json is damaged"

# Top-level keys of zerodp_state.json and the JSON types each may have (None: null allowed).
_SHARED_KEYS: dict[str, tuple[type, ...]] = {
    "format": (str,),
    "format_version": (int,),
    "zero_stage": (int,),
    "world_size": (int,),
    "param_dtype": (str,),
    "params": (dict,),
    "tied": (dict,),
    "buffers": (dict,),
    "state_dict_keys": (list,),
    "counters": (dict,),
    "optimizer": (dict,),
    "loss_scaler": (dict,),
    "lr_scheduler": (dict, type(None)),
    "dataloader": (dict, type(None)),
}


def check_shared_state(shared: dict[str, Any]) -> None:
    """Every key zerodp reads from zerodp_state.json is there, with its JSON type."""
    for key, types in _SHARED_KEYS.items():
        if key not in shared:
            raise CheckpointError(f"checkpoint state: '{key}' is missing; {_DAMAGED}")
        value = shared[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise CheckpointError(
                f"checkpoint state: '{key}' is {_describe(value)}, expected "
                f"{' or '.join(_JSON_NAMES.get(t, t.__name__) for t in types)}; {_DAMAGED}"
            )
    if shared["world_size"] < 1 or shared["zero_stage"] not in (0, 1, 2, 3):
        raise CheckpointError(
            f"checkpoint state: world_size or zero_stage out of range; {_DAMAGED}"
        )
    for name, info in shared["params"].items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            raise CheckpointError(
                f"checkpoint state: params['{name}'] has no valid shape; {_DAMAGED}"
            )
    for name, shape in shared["buffers"].items():
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            raise CheckpointError(
                f"checkpoint state: buffers['{name}'] has no valid shape; {_DAMAGED}"
            )
    if not all(isinstance(k, str) for k in shared["state_dict_keys"]):
        raise CheckpointError(f"checkpoint state: state_dict_keys holds a non-string; {_DAMAGED}")
    if not all(isinstance(v, str) for v in shared["tied"].values()):
        raise CheckpointError(f"checkpoint state: 'tied' holds a non-string; {_DAMAGED}")


def check_like(saved: Any, current: Any, where: str) -> None:
    """`saved` has the structure of `current` (a live object's JSON state): same dict keys,
    same list lengths, and leaves of compatible types (numbers finite where `current` is)."""
    if current is None or saved is None:
        return  # optional values (e.g. a scheduler's last value before its first step)
    if isinstance(current, dict):
        if not isinstance(saved, dict):
            raise _mismatch(where, saved, current)
        missing = sorted(set(current) - set(saved))
        if missing:
            raise CheckpointError(f"{where}: {missing} missing in the checkpoint; {_DAMAGED}")
        for key in current:
            check_like(saved[key], current[key], f"{where}['{key}']")
        return
    if isinstance(current, list):
        if not isinstance(saved, list) or len(saved) != len(current):
            raise _mismatch(where, saved, current)
        for index, (a, b) in enumerate(zip(saved, current, strict=True)):
            check_like(a, b, f"{where}[{index}]")
        return
    if isinstance(current, bool) or isinstance(saved, bool):
        if type(saved) is not type(current):
            raise _mismatch(where, saved, current)
        return
    if isinstance(current, (int, float)):
        if not isinstance(saved, (int, float)):
            raise _mismatch(where, saved, current)
        if math.isfinite(current) and not math.isfinite(saved):
            raise _mismatch(where, saved, current)
        return
    if type(saved) is not type(current):
        raise _mismatch(where, saved, current)


def check_counts(state: Any, where: str) -> None:
    """Every value of a JSON object of counters is a non-negative integer."""
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{where}: expected a JSON object, got {_describe(state)}; {_DAMAGED}"
        )
    for key, value in state.items():
        if not _is_count(value):
            raise CheckpointError(
                f"{where}['{key}']: expected a non-negative integer, got {value!r}; {_DAMAGED}"
            )


def check_rank_state(state: Any, file: str) -> None:
    """A `rank<r>.json`: Python's (and NumPy's) generator states, tried on scratch generators."""
    if not isinstance(state, dict) or "python_random" not in state:
        raise CheckpointError(f"'{file}' is not a zerodp rank state file")
    try:
        random.Random().setstate(from_jsonable(state["python_random"]))
    except (TypeError, ValueError, OverflowError) as error:
        raise CheckpointError(
            f"'{file}': python_random is not a generator state ({error})"
        ) from None
    numpy_state = state.get("numpy_random")
    if numpy_state is None:
        return
    try:
        import numpy as np
    except ImportError:
        return
    try:
        kind, keys, position, has_gauss, cached = numpy_state
        np.random.RandomState().set_state(
            (kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached)
        )
    except (TypeError, ValueError, OverflowError) as error:
        raise CheckpointError(
            f"'{file}': numpy_random is not a generator state ({error})"
        ) from None


def live_state(obj: Any) -> Any:
    """A live object's state as the JSON it would be saved as."""
    return to_jsonable(obj.state_dict())


_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer"}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def _mismatch(where: str, saved: Any, current: Any) -> CheckpointError:
    return CheckpointError(
        f"{where}: the checkpoint holds {_describe(saved)} where this engine has "
        f"{_describe(current)} ({type(current).__name__}); {_DAMAGED}, or it was saved by a "
        "different setup"
    )
