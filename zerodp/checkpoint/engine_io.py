"""`save_checkpoint` and `load_checkpoint`: an engine's state through torch.distributed.checkpoint.

Both validate on every rank and agree on the verdict before the first
collective (see `Comm.raise_if_any_failed`), so a bad path or tag, or a
checkpoint for another model, is an error on every rank and no rank is left
waiting. Tensors go through DCP (see `zerodp.checkpoint.tensors`); the rest
is JSON (`zerodp.checkpoint.plain`). Saving is atomic (`zerodp.checkpoint.paths`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zerodp.backward import autograd_api
from zerodp.checkpoint import integrity, plain, tensors
from zerodp.checkpoint.paths import (
    check_load_source,
    check_save_target,
    commit,
    has_latest,
    new_temp_name,
)
from zerodp.checkpoint.tensors import quiet_sharded_tensor_warnings
from zerodp.errors import CheckpointError, LifecycleError

if TYPE_CHECKING:
    from zerodp.engine import ZeroEngine

logger = logging.getLogger("zerodp")

_USER_ERRORS = (ValueError, TypeError, OSError, CheckpointError, LifecycleError)


def _check_not_in_backward(engine: ZeroEngine) -> None:
    engine._abort_stale_backward()
    if autograd_api.in_backward():
        raise LifecycleError("a checkpoint cannot be saved or loaded inside a backward")


def save_checkpoint(
    engine: ZeroEngine, save_dir: Any, tag: str | None = None, client_state: Any = None
) -> Path:
    comm = engine.comm
    error: BaseException | None = None
    directory = Path(".")
    shared: dict[str, Any] = {}
    client_tensors: dict[str, torch.Tensor] = {}
    try:
        _check_not_in_backward(engine)
        directory = check_save_target(save_dir, tag)
        tag = tag if tag is not None else f"global_step{engine.global_steps}"
        client_json, client_tensors = plain.encode_client_state(
            {} if client_state is None else client_state
        )
        shared = plain.shared_state(engine, client_json)
        json.dumps(shared, allow_nan=True)
    except _USER_ERRORS as caught:
        error = caught
    comm.raise_if_any_failed(error)
    if tag is None:  # pragma: no cover - set above on every rank
        raise RuntimeError("internal error: no tag")

    temp_name = comm.broadcast_object(new_temp_name(tag) if comm.rank == 0 else None)
    temp = directory / temp_name
    error = None
    if comm.rank == 0:
        try:
            temp.mkdir(parents=True)
        except OSError as caught:
            error = caught
    comm.raise_if_any_failed(error)

    state: dict[str, Any] = {
        **tensors.model_tensors(engine),
        **tensors.master_tensors(engine),
        **tensors.optimizer_tensors(engine),
        **tensors.rng_tensors(comm.rank),
    }
    if comm.rank == 0:
        state.update(client_tensors)
    writer = FileSystemWriter(str(temp), single_file_per_rank=True, sync_files=True)
    with quiet_sharded_tensor_warnings():
        dcp.save(state, storage_writer=writer, process_group=comm.group)

    error = None
    try:
        plain.write_json(temp / f"rank{comm.rank}.json", plain.rank_state())
        if comm.rank == 0:
            plain.write_json(temp / plain.STATE_FILE, shared)
    except OSError as caught:
        error = caught
    comm.raise_if_any_failed(error)  # every rank has written everything

    error = None
    if comm.rank == 0:
        try:
            commit(directory, temp_name, tag)
        except OSError as caught:
            error = caught
    comm.raise_if_any_failed(error)
    return directory / tag


def load_checkpoint(
    engine: ZeroEngine,
    load_dir: Any,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, Any]:
    comm = engine.comm
    if tag is None and not _any_latest(engine, load_dir):
        # As in DeepSpeed: nothing saved yet is not an error; the caller starts afresh.
        if comm.rank == 0:
            logger.warning("no checkpoint to load in %s (no 'latest' file)", load_dir)
        return None, None
    error: BaseException | None = None
    path = Path(".")
    shared: dict[str, Any] = {}
    saved: dict[str, TensorStorageMetadata] = {}
    rank_json: dict[str, Any] | None = None
    try:
        _check_not_in_backward(engine)
        path, tag = check_load_source(load_dir, tag)
        shared = plain.read_shared_state(path)
        integrity.check_model(engine.module, shared)
        metadata = integrity.read_metadata(path)
        integrity.check_files(path, metadata)
        saved = integrity.saved_keys(metadata)
        rank_file = path / f"rank{comm.rank}.json"
        if rank_file.is_file():
            rank_json = json.loads(rank_file.read_text())
    except _USER_ERRORS as caught:
        error = caught
    comm.raise_if_any_failed(error)

    with_optimizer = load_optimizer_states and not load_module_only
    destinations = _model_destinations(engine, saved)
    if with_optimizer:
        error = None
        try:
            destinations.update(_optimizer_destinations(engine, saved))
        except CheckpointError as caught:
            error = caught
        comm.raise_if_any_failed(error)
    rng = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in saved.items()
        if k.startswith(f"rng.rank{comm.rank}.")
    }
    client = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in saved.items()
        if k.startswith("client.")
    }
    destinations.update(rng)
    destinations.update(client)
    try:
        with quiet_sharded_tensor_warnings():
            reader = FileSystemReader(str(path))
            dcp.load(destinations, storage_reader=reader, process_group=comm.group)
    except Exception as caught:
        raise CheckpointError(f"reading checkpoint '{path}' failed: {caught}") from caught

    engine.optimizer.sync_params_from_owned()
    engine.zero_grad()
    if not load_module_only:
        counters = shared["counters"]
        engine.global_steps = int(counters["global_steps"])
        engine.micro_steps = int(counters["micro_steps"])
        engine.global_samples = int(counters["global_samples"])
        engine.optimizer.skipped_steps = int(counters["skipped_steps"])
        if with_optimizer:
            plain.apply_optimizer_settings(engine, shared["optimizer"]["param_groups"])
            engine.optimizer.loss_scaler.load_state_dict(shared["loss_scaler"])
        if load_lr_scheduler_states:
            plain.apply_scheduler_state(engine, shared.get("lr_scheduler"))
        loader = engine.training_dataloader
        if loader is not None and shared.get("dataloader") is not None:
            loader.load_state_dict(shared["dataloader"])
        tensors.restore_rng(rng, comm.rank)
        if rank_json is not None:
            plain.restore_rank_state(rank_json)
    return str(path), plain.decode_client_state(shared.get("client_state"), client)


def _any_latest(engine: ZeroEngine, load_dir: Any) -> bool:
    """Whether a newest checkpoint exists, agreed by all ranks (all must see the same files)."""
    error: BaseException | None = None
    found = False
    try:
        found = has_latest(load_dir)
    except (ValueError, TypeError) as caught:
        error = caught
    engine.comm.raise_if_any_failed(error)
    views = engine.comm.all_gather_object(found)
    if any(views) and not all(views):
        raise CheckpointError(
            f"ranks disagree on whether '{load_dir}' holds a checkpoint (ranks "
            f"{[r for r, v in enumerate(views) if not v]} see none): put it on storage every "
            "rank can read"
        )
    return found


def _model_destinations(engine: ZeroEngine, saved: dict[str, Any]) -> dict[str, Any]:
    """Where the saved values go: fp32 values (masters, when saved) into the fp32 copies."""
    model = tensors.model_tensors(engine)
    masters = tensors.master_tensors(engine)
    destinations: dict[str, Any] = {}
    for key, tensor in model.items():
        if not key.startswith("model."):
            if key in saved:
                destinations[key] = tensor
            continue
        name = key.removeprefix("model.")
        saved_master = f"master.{name}" in saved
        if f"master.{name}" in masters:
            # The engine keeps an fp32 master: fill it with the best fp32 values saved; the
            # model's half-precision copy is refreshed from it afterwards.
            source = f"master.{name}" if saved_master else key
            destinations[source] = masters[f"master.{name}"]
        else:
            destinations[f"master.{name}" if saved_master else key] = tensor
    return destinations


def _optimizer_destinations(engine: ZeroEngine, saved: dict[str, Any]) -> dict[str, Any]:
    saved_optim = {k for k in saved if k.startswith("optim.")}
    if not saved_optim:
        return {}
    _create_missing_state(engine, saved)
    wanted = tensors.optimizer_tensors(engine)
    missing = sorted(set(wanted) - saved_optim)
    unexpected = sorted(saved_optim - set(wanted))
    if missing or unexpected:
        raise CheckpointError(
            "the checkpoint's optimizer state does not match this optimizer (was it saved "
            f"with a different optimizer class?): missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; pass load_optimizer_states=False to load the weights only"
        )
    return wanted


def _create_missing_state(engine: ZeroEngine, saved: dict[str, Any]) -> None:
    """Torch optimizers create state on their first step; make it now, shaped as saved."""
    state = engine.optimizer.state
    for entry in tensors.param_entries(engine):
        if entry.group is None:
            continue
        shard = engine.full_state.shard_params.get(id(entry.group))
        if shard is None or state.get(shard):
            continue
        prefix = f"optim.{entry.name}."
        slots: dict[str, torch.Tensor] = {}
        for key, meta in saved.items():
            if not key.startswith(prefix):
                continue
            dtype = meta.properties.dtype
            if len(meta.size) == 0:
                slots[key.removeprefix(prefix)] = torch.zeros((), dtype=dtype)
            else:
                slots[key.removeprefix(prefix)] = torch.zeros_like(shard, dtype=dtype)
        if slots:
            state[shard] = slots
