"""The non-tensor part of a checkpoint, as JSON: nothing is ever unpickled from it.

`zerodp_state.json` (written by rank 0) holds what every rank shares:
counters, the optimizer's param-group settings, the LR scheduler, the loss
scaler, the data loader's position, a description of the model (names,
shapes, dtypes, state-dict keys, tied names) and the user's `client_state`.
`rank<r>.json` holds each rank's Python and NumPy random states. Tensors in
`client_state` are stored by DCP under `client.<n>` and replaced in the JSON
by a reference (see `zerodp.checkpoint_io.jsonable`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from zerodp.checkpoint_io.jsonable import from_jsonable, to_jsonable
from zerodp.checkpoint_io.paths import write_file_synced
from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.errors import CheckpointError

STATE_FILE = "zerodp_state.json"
FORMAT = "zerodp-checkpoint"
FORMAT_VERSION = 2  # 2: checksums.json, kept gradients of a window


def shared_state(subject: CheckpointSubject, client_json: Any) -> dict[str, Any]:
    module = subject.module
    shapes = subject.recorded_shapes()
    params = {
        name: {"shape": shapes[name], "dtype": str(p.dtype).removeprefix("torch.")}
        for name, p in module.named_parameters()
    }
    first_name = {id(p): name for name, p in module.named_parameters()}
    aliases = {
        name: first_name[id(p)]
        for name, p in module.named_parameters(remove_duplicate=False)
        if first_name[id(p)] != name
    }
    scheduler, loader = subject.lr_scheduler, subject.dataloader
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "zero_stage": subject.zero_stage,
        "world_size": subject.comm.world_size,
        "param_dtype": str(subject.param_dtype).removeprefix("torch."),
        "params": params,
        "tied": aliases,
        "buffers": {name: list(b.shape) for name, b in module.named_buffers()},
        "state_dict_keys": list(module.state_dict(keep_vars=True).keys()),
        "counters": subject.counters.state_dict(),
        "optimizer": subject.optimizer_settings.state_dict(),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "loss_scaler": subject.loss_scaler.state_dict(),
        "dataloader": loader.state_dict() if loader is not None else None,
        "accumulation_steps": subject.accumulation_steps,
        "client_state": client_json,
    }


def counters_to_load(shared: dict[str, Any], accumulation_steps: int) -> dict[str, Any]:
    """The saved counters as this engine continues them; `CheckpointError` when it cannot.

    A run resumed with another number of data ranks keeps `train_batch_size`, so its
    accumulation steps A change (`config.batch`). Where the next step's window starts is
    counted from the micro-steps (`micro_steps % A`), so a checkpoint saved at a window's
    boundary continues with micro_steps = global_steps x A, as if the run had always
    accumulated A (as a DeepSpeed checkpoint is loaded); one saved inside a window cannot
    be continued with another A. Checkpoints without the saved A count with this one.
    """
    counters = dict(shared["counters"])
    saved = shared.get("accumulation_steps", accumulation_steps)
    if isinstance(saved, bool) or not isinstance(saved, int) or saved < 1:
        raise CheckpointError(
            f"checkpoint state: 'accumulation_steps' is {saved!r}; the checkpoint's "
            f"{STATE_FILE} is damaged"
        )
    if saved == accumulation_steps:
        return counters
    inside = counters["micro_steps"] % saved
    if inside:
        raise CheckpointError(
            f"the checkpoint was saved {inside} micro-steps into an accumulation window of "
            f"{saved}; this engine accumulates {accumulation_steps} (another number of data "
            "ranks, or another train_batch_size): resume it with the world size that saved "
            "it, or from a checkpoint saved at an optimizer step's boundary"
        )
    counters["micro_steps"] = counters["global_steps"] * accumulation_steps
    return counters


def rank_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python_random": to_jsonable(random.getstate())}
    try:
        import numpy as np

        kind, keys, position, has_gauss, cached = np.random.get_state()
        state["numpy_random"] = [kind, np.asarray(keys).tolist(), position, has_gauss, cached]
    except ImportError:
        state["numpy_random"] = None
    return state


def restore_rank_state(state: dict[str, Any]) -> None:
    random.setstate(from_jsonable(state["python_random"]))
    if state.get("numpy_random") is not None:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, position, has_gauss, cached = state["numpy_random"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached))


def json_text(data: Any) -> str:
    """`data` as the text of a checkpoint JSON file (raises if it is not JSON)."""
    return json.dumps(data, indent=1, allow_nan=True)


def write_json(path: Path, data: Any) -> None:
    write_json_text(path, json_text(data))


def write_json_text(path: Path, text: str) -> None:
    write_file_synced(path, text.encode())


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
    version = data.get("format_version", 0)
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"'{path}' was written by a newer zerodp (format {data['format_version']}); "
            "upgrade zerodp to load it"
        )
    return data
