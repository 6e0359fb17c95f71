"""`save_checkpoint` and `load_checkpoint`: an engine's state through torch.distributed.checkpoint.

Both validate on every rank and agree on the verdict before the first
collective (see `Comm.raise_if_any_failed`), so a bad path or tag, or a
checkpoint for another model, is an error on every rank and no rank is left
waiting. A load checks everything it can know before reading a tensor
(files, model, optimizer state keys, param-group count, every JSON piece) and
changes nothing until every check has passed on every rank. Tensors go
through DCP (see `zerodp.checkpoint.tensors`); the rest is JSON
(`zerodp.checkpoint.plain`). Saving is atomic (`zerodp.checkpoint.paths`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zerodp.checkpoint import integrity, plain, tensors
from zerodp.checkpoint.jsonable import from_jsonable, to_jsonable
from zerodp.checkpoint.paths import (
    check_load_source,
    check_save_target,
    commit,
    has_latest,
    new_temp_name,
)
from zerodp.checkpoint.sharded import quiet_sharded_tensor_warnings
from zerodp.checkpoint.subject import CheckpointSubject
from zerodp.errors import CheckpointError, LifecycleError
from zerodp.group import GroupState

logger = logging.getLogger("zerodp")

_USER_ERRORS = (ValueError, TypeError, OSError, CheckpointError, LifecycleError)


def save_checkpoint(
    subject: CheckpointSubject, save_dir: Any, tag: str | None = None, client_state: Any = None
) -> Path:
    comm = subject.comm
    error: BaseException | None = None
    directory = Path(".")
    shared: dict[str, Any] = {}
    client_tensors: dict[str, torch.Tensor] = {}
    try:
        subject.check_idle()
        directory = check_save_target(save_dir, tag)
        tag = (
            tag
            if tag is not None
            else f"global_step{subject.counters.state_dict()['global_steps']}"
        )
        client_json = to_jsonable({} if client_state is None else client_state, client_tensors)
        shared = plain.shared_state(subject, client_json)
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
        **tensors.model_tensors(subject),
        **tensors.master_tensors(subject),
        **tensors.optimizer_tensors(subject),
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
    subject: CheckpointSubject,
    load_dir: Any,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, Any]:
    comm = subject.comm
    if tag is None and not _any_latest(subject, load_dir):
        # As in DeepSpeed: nothing saved yet is not an error; the caller starts afresh.
        if comm.rank == 0:
            logger.warning("no checkpoint to load in %s (no 'latest' file)", load_dir)
        return None, None
    with_optimizer = load_optimizer_states and not load_module_only
    error: BaseException | None = None
    path = Path(".")
    shared: dict[str, Any] = {}
    destinations: dict[str, Any] = {}
    planned: PlannedState = {}
    rank_json: dict[str, Any] | None = None
    try:
        subject.check_idle()
        path, tag = check_load_source(load_dir, tag)
        shared = plain.read_shared_state(path)
        integrity.check_model(subject.module, shared)
        metadata = integrity.read_metadata(path)
        integrity.check_files(path, metadata)
        saved = integrity.saved_keys(metadata)
        _check_json_pieces(subject, shared, with_optimizer, load_lr_scheduler_states)
        rank_json = _read_rank_json(path, comm.rank)
        destinations = _model_destinations(subject, saved)
        if with_optimizer:
            planned = _plan_missing_state(subject, saved)
            destinations.update(_optimizer_destinations(subject, saved, planned))
        destinations.update(_fresh_tensors(saved, f"rng.rank{comm.rank}."))
        destinations.update(_fresh_tensors(saved, "client."))
    except _USER_ERRORS as caught:
        error = caught
    comm.raise_if_any_failed(error)  # nothing has been changed yet, on any rank

    _attach_planned_state(subject, planned)
    try:
        with quiet_sharded_tensor_warnings():
            reader = FileSystemReader(str(path))
            dcp.load(destinations, storage_reader=reader, process_group=comm.group)
    except Exception as caught:
        raise CheckpointError(f"reading checkpoint '{path}' failed: {caught}") from caught

    subject.after_load()
    if not load_module_only:
        subject.counters.load_state_dict(shared["counters"])
        if with_optimizer:
            subject.optimizer_settings.load_state_dict(shared["optimizer"])
            subject.loss_scaler.load_state_dict(shared["loss_scaler"])
        scheduler_state = shared.get("lr_scheduler")
        if load_lr_scheduler_states and subject.lr_scheduler is not None and scheduler_state:
            subject.lr_scheduler.load_state_dict(scheduler_state)
        if subject.dataloader is not None and shared.get("dataloader") is not None:
            subject.dataloader.load_state_dict(shared["dataloader"])
        rng = {k: v for k, v in destinations.items() if k.startswith("rng.")}
        tensors.restore_rng(rng, comm.rank)
        if rank_json is not None:
            plain.restore_rank_state(rank_json)
    client = {k: v for k, v in destinations.items() if k.startswith("client.")}
    return str(path), from_jsonable(shared.get("client_state"), client)


# -- checks, all made before anything changes ---------------------------------------------


def _check_json_pieces(
    subject: CheckpointSubject,
    shared: dict[str, Any],
    with_optimizer: bool,
    with_scheduler: bool,
) -> None:
    """Every JSON piece the load will apply must fit what it is applied to."""
    subject.counters.check_state_dict(shared.get("counters"))
    if with_optimizer:
        subject.optimizer_settings.check_state_dict(shared.get("optimizer"))
        subject.loss_scaler.check_state_dict(shared.get("loss_scaler"))
    scheduler_state = shared.get("lr_scheduler")
    check = getattr(subject.lr_scheduler, "check_state_dict", None)
    if with_scheduler and scheduler_state is not None and check is not None:
        check(scheduler_state)


def _read_rank_json(path: Path, rank: int) -> dict[str, Any] | None:
    """This rank's random states; None when the checkpoint had fewer ranks than this run."""
    file = path / f"rank{rank}.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"'{file}' is unreadable or corrupted: {error}") from None
    if not isinstance(data, dict) or "python_random" not in data:
        raise CheckpointError(f"'{file}' is not a zerodp rank state file")
    return data


def _fresh_tensors(saved: dict[str, TensorStorageMetadata], prefix: str) -> dict[str, Any]:
    return {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in saved.items()
        if k.startswith(prefix)
    }


def _any_latest(subject: CheckpointSubject, load_dir: Any) -> bool:
    """Whether a newest checkpoint exists, agreed by all ranks (all must see the same files)."""
    error: BaseException | None = None
    found = False
    try:
        found = has_latest(load_dir)
    except (ValueError, TypeError) as caught:
        error = caught
    subject.comm.raise_if_any_failed(error)
    views = subject.comm.all_gather_object(found)
    if any(views) and not all(views):
        raise CheckpointError(
            f"ranks disagree on whether '{load_dir}' holds a checkpoint (ranks "
            f"{[r for r, v in enumerate(views) if not v]} see none): put it on storage every "
            "rank can read"
        )
    return found


def _model_destinations(subject: CheckpointSubject, saved: dict[str, Any]) -> dict[str, Any]:
    """Where the saved values go: fp32 values (masters, when saved) into the fp32 copies."""
    model = tensors.model_tensors(subject)
    masters = tensors.master_tensors(subject)
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


PlannedState = dict[GroupState, dict[str, torch.Tensor]]


def _optimizer_destinations(
    subject: CheckpointSubject, saved: dict[str, Any], planned: PlannedState
) -> dict[str, Any]:
    """The optimizer state's destinations, including state `planned` for a fresh optimizer."""
    saved_optim = {k for k in saved if k.startswith("optim.")}
    if not saved_optim:
        return {}
    wanted = tensors.optimizer_tensors(subject, planned)
    missing = sorted(set(wanted) - saved_optim)
    unexpected = sorted(saved_optim - set(wanted))
    if missing or unexpected:
        raise CheckpointError(
            "the checkpoint's optimizer state does not match this optimizer (was it saved "
            f"with a different optimizer class?): missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; pass load_optimizer_states=False to load the weights only"
        )
    return wanted


def _plan_missing_state(subject: CheckpointSubject, saved: dict[str, Any]) -> PlannedState:
    """The state a fresh torch optimizer creates only at its first step, shaped as saved.

    Only planned here (new tensors, nothing attached to the optimizer): the
    load attaches them once every rank has agreed that every check passed.
    """
    existing = subject.optimizer.state
    planned: PlannedState = {}
    for entry in tensors.param_entries(subject):
        state = entry.state
        if state is None or state.optim is None or existing.get(state.optim.param):
            continue
        owned = state.optim.param
        slots = planned.setdefault(state, {})
        prefix = f"optim.{entry.name}."
        for key, meta in saved.items():
            slot = key.removeprefix(prefix)
            if not key.startswith(prefix) or slot in slots:
                continue
            dtype = meta.properties.dtype
            if len(meta.size) == 0:
                slots[slot] = torch.zeros((), dtype=dtype)
            else:
                slots[slot] = torch.zeros_like(owned, dtype=dtype)
    return {state: slots for state, slots in planned.items() if slots}


def _attach_planned_state(subject: CheckpointSubject, planned: PlannedState) -> None:
    for state, slots in planned.items():
        if state.optim is not None:
            subject.optimizer.state[state.optim.param] = slots
