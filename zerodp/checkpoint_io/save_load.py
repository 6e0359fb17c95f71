"""`save_checkpoint` and `load_checkpoint`: an engine's state through torch.distributed.checkpoint.

Both validate on every rank and agree on the verdict before the first
collective (see `Comm.raise_if_any_failed`), so a bad path or tag, or a
checkpoint for another model, is an error on every rank and no rank is left
waiting. A load checks everything it can know before reading a tensor
(checksums of every file, the model, the optimizer class and settings,
param-group count, every JSON value, every rank's generator states) and
changes nothing until every check has passed on every rank. Nothing is
unpickled from a checkpoint (`zerodp.checkpoint_io.safe_metadata`). Tensors
go through DCP (see `zerodp.checkpoint_io.tensors`); the rest is JSON
(`zerodp.checkpoint_io.json_state`). Saving is atomic (`zerodp.checkpoint_io.paths`)
and every failure of it, DCP's own included, is one `CheckpointError` with
the same message on every rank, after which the engine trains on. The
synchronous save here writes and commits before it returns; the decoupled one
(`zerodp.checkpoint_io.writers`) starts from the same `SaveRequest`.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from zerodp.checkpoint_io import (
    checksums,
    destinations,
    integrity,
    json_state,
    schema,
    tensor_relayout,
    tensor_slices,
    tensors,
    window_gradients,
)
from zerodp.checkpoint_io.agreed import agreed, root_cause
from zerodp.checkpoint_io.jsonable import from_jsonable
from zerodp.checkpoint_io.load_options import LoadOptions
from zerodp.checkpoint_io.paths import check_load_source, commit, has_latest
from zerodp.checkpoint_io.safe_metadata import METADATA_FILE, SafeReader, read_metadata
from zerodp.checkpoint_io.save_request import (
    SaveRequest,
    abandon,
    prepare_save,
    state_tensors,
    write_json_files,
)
from zerodp.checkpoint_io.sharded import quiet_sharded_tensor_warnings
from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.comm import Comm
from zerodp.errors import CheckpointError, ZeroDPError

logger = logging.getLogger("zerodp")

_FAILURES = integrity.CHECKPOINT_FAILURES


def save_checkpoint(
    subject: CheckpointSubject,
    save_dir: Any,
    tag: str | None = None,
    client_state: Any = None,
    *,
    random_states: bool = True,
) -> Path:
    """Write the checkpoint now and commit it before returning (the synchronous writer).

    `random_states=False` leaves the random generator states out (they are not the run's:
    `zerodp convert`); a load then leaves the generators as they are."""
    request = prepare_save(subject, save_dir, tag, client_state, random_states)
    try:
        _write(subject, request)
    except CheckpointError:
        abandon(subject.comm, request.directory)  # every rank has stopped writing: agreed
        raise
    return request.final


def _write(subject: CheckpointSubject, request: SaveRequest) -> None:
    """Write everything under the temporary directory, agreeing after each phase, then
    commit (rank 0)."""
    comm = subject.comm
    where = request.where
    written: list[Any] = []

    def write_tensors() -> None:
        state = state_tensors(subject, request)
        writer = FileSystemWriter(str(request.temp), single_file_per_rank=True, sync_files=True)
        with quiet_sharded_tensor_warnings():
            written.append(dcp.save(state, storage_writer=writer, process_group=comm.group))

    agreed(comm, where, write_tensors)
    entries: dict[str, dict[str, Any]] = {}

    def write_json_and_hash() -> None:
        entries.update(write_json_files(request, comm.rank))
        if comm.rank == 0:
            entries[METADATA_FILE] = checksums.small_file_entry(request.temp / METADATA_FILE)
        chunks = checksums.chunks_by_file(written[0])
        for name in checksums.my_share(chunks, comm.rank, comm.world_size):
            entries[name] = checksums.data_file_entry(request.temp / name, chunks[name])

    agreed(comm, where, write_json_and_hash)
    gathered = comm.all_gather_object(entries)

    def finish() -> None:
        if comm.rank == 0:
            files = {name: entry for part in gathered for name, entry in part.items()}
            checksums.write_manifest(request.temp, files)  # last: a directory with it is complete
            commit(request.directory, request.temp.name, request.tag)

    agreed(comm, where, finish)


def load_checkpoint(
    subject: CheckpointSubject, load_dir: Any, options: LoadOptions
) -> tuple[str | None, Any, dict[str, str]]:
    """(path, client_state, what was left as it was: {piece: why}); the path is None when
    there is nothing to load."""
    comm = subject.comm
    tag = options.tag
    if tag is None and not _any_latest(subject, load_dir):
        # As in DeepSpeed: nothing saved yet is not an error; the caller starts afresh.
        if comm.rank == 0:
            logger.warning("no checkpoint to load in %s (no 'latest' file)", load_dir)
        return None, None, {}
    with_optimizer = options.with_optimizer
    verify_checksums = options.verify_checksums
    error: BaseException | None = None
    path = Path(".")
    shared: dict[str, Any] = {}
    wanted: dict[str, Any] = {}
    planned: destinations.PlannedState = {}
    grads = window_gradients.GradientLoad()
    relayout = tensor_relayout.Relayout({}, {})
    rank_json: dict[str, Any] | None = None
    metadata: Any = None
    try:
        subject.check_idle()
        path, tag = check_load_source(load_dir, tag)
        manifest = checksums.read_manifest(path) if verify_checksums else None
        if verify_checksums and manifest is None:
            _warn_unverified(comm, path)
        if manifest is not None:
            for name in (METADATA_FILE, json_state.STATE_FILE):
                checksums.check_small_file(path, name, manifest)
        shared = json_state.read_shared_state(path)
        schema.check_shared_state(shared)
        metadata = read_metadata(path)
        integrity.check_files(path, metadata)
        cuts = tensor_slices.cuts(subject, shared)  # this model, at this or another T
        saved = integrity.saved_keys(metadata)
        relayout = tensor_relayout.Relayout(cuts, saved)
        if manifest is not None:
            chunks = checksums.chunks_by_file(metadata)
            for name in checksums.my_share(chunks, comm.rank, comm.world_size):
                checksums.check_data_file(path, name, chunks[name], manifest)
        _check_json_pieces(subject, shared, with_optimizer, options.load_lr_scheduler_states)
        if _has_random_states(shared):
            rank_json = _read_rank_json(path, comm.rank, shared["world_size"], manifest)
            destinations.check_rng(saved, shared["world_size"])
        wanted = destinations.model_destinations(subject, saved)
        if with_optimizer:
            planned = destinations.plan_missing_state(subject, saved)
            wanted.update(destinations.optimizer_destinations(subject, saved, planned))
        wanted.update(destinations.fresh_tensors(saved, f"rng.rank{comm.rank}."))
        wanted.update(destinations.fresh_tensors(saved, "client."))
        if not options.load_module_only:
            grads = window_gradients.plan_load(subject, shared, saved, with_optimizer, relayout)
            wanted.update(grads.destinations)
            json_state.counters_to_load(shared, subject.accumulation_steps)  # a resize fits
        relayout.take_from(wanted)  # [Note: another tensor-parallel degree]
        destinations.check_kinds(wanted, saved, metadata)
    except _FAILURES as caught:
        error = caught if isinstance(caught, ZeroDPError) else _unexpected(caught, path)
    comm.raise_if_any_failed(error)  # nothing has been changed yet, on any rank

    destinations.attach_planned_state(subject, planned)
    _read_tensors(comm, path, metadata, wanted, relayout)

    subject.after_load()
    if not options.load_module_only:
        subject.counters.load_state_dict(
            json_state.counters_to_load(shared, subject.accumulation_steps)
        )
        if with_optimizer:
            subject.optimizer_settings.load_state_dict(shared["optimizer"])
            subject.loss_scaler.load_state_dict(shared["loss_scaler"])
        scheduler_state = shared.get("lr_scheduler")
        if (
            options.load_lr_scheduler_states
            and subject.lr_scheduler is not None
            and scheduler_state
        ):
            subject.lr_scheduler.load_state_dict(scheduler_state)
        if subject.dataloader is not None and shared.get("dataloader") is not None:
            subject.dataloader.load_state_dict(shared["dataloader"])
        rng = {k: v for k, v in wanted.items() if k.startswith("rng.")}
        tensors.restore_rng(rng, comm.rank)
        if rank_json is not None:
            json_state.restore_rank_state(rank_json)
        grads.apply(subject)
    client = {k: v for k, v in wanted.items() if k.startswith("client.")}
    left = (
        {}
        if options.load_module_only
        else _left_as_they_were(subject, shared, options.load_lr_scheduler_states)
    )
    return str(path), from_jsonable(shared.get("client_state"), client), left


def _read_tensors(
    comm: Comm,
    path: Path,
    metadata: Any,
    wanted: dict[str, Any],
    relayout: tensor_relayout.Relayout,
) -> None:
    """DCP reads `wanted` in place, then the parameters cut otherwise than saved (another
    T: [Note: another tensor-parallel degree]); a failure is agreed on every rank."""
    error = None
    try:
        with quiet_sharded_tensor_warnings():
            reader = SafeReader(path, metadata)
            dcp.load(wanted, storage_reader=reader, process_group=comm.group)
    except _FAILURES as caught:
        error = CheckpointError(f"reading checkpoint '{path}' failed: {root_cause(caught)}")
    comm.raise_if_any_failed(error)
    relayout.read(comm, lambda: SafeReader(path, metadata), f"checkpoint '{path}'")


def _has_random_states(shared: dict[str, Any]) -> bool:
    """Whether the checkpoint keeps the saving ranks' random generator states (it does unless
    it was written without them: `save_checkpoint(random_states=False)`)."""
    value = shared.get("random_states", True)
    if not isinstance(value, bool):
        raise CheckpointError(
            f"checkpoint state: 'random_states' is {value!r}, expected true or false; the "
            "checkpoint's zerodp_state.json is damaged"
        )
    return value


def _left_as_they_were(
    subject: CheckpointSubject, shared: dict[str, Any], with_scheduler: bool
) -> dict[str, str]:
    """The pieces this engine has that the checkpoint held nothing for, and why."""
    left: dict[str, str] = {}
    if not _has_random_states(shared):
        left["random generators"] = "the checkpoint keeps no random generator states"
    if subject.lr_scheduler is not None and with_scheduler and not shared.get("lr_scheduler"):
        left["LR scheduler"] = "the checkpoint has no LR scheduler state"
    elif subject.lr_scheduler is None and shared.get("lr_scheduler"):
        left["LR scheduler"] = "the checkpoint's LR scheduler state: this engine has no scheduler"
    if subject.dataloader is not None and shared.get("dataloader") is None:
        left["data-loader position"] = "the checkpoint has no data-loader position"
    return left


# -- checks, all made before anything changes ---------------------------------------------


def _unexpected(error: BaseException, path: Path) -> CheckpointError:
    return CheckpointError(
        f"checkpoint '{path}' could not be checked ({type(error).__name__}: {error}); it is "
        "damaged or was not written by this zerodp"
    )


def _warn_unverified(comm: Comm, path: Path) -> None:
    if comm.rank == 0:
        logger.warning(
            "checkpoint '%s' has no %s (written by an older zerodp): its data is not verified",
            path,
            checksums.CHECKSUM_FILE,
        )


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
        scale = shared["loss_scaler"].get("scale")
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise CheckpointError(
                f"checkpoint loss_scaler 'scale' is {scale!r}, not a positive finite number; "
                "the checkpoint's zerodp_state.json is damaged"
            )
    scheduler_state = shared.get("lr_scheduler")
    check = getattr(subject.lr_scheduler, "check_state_dict", None)
    if with_scheduler and scheduler_state is not None and check is not None:
        check(scheduler_state)
    loader_state = shared.get("dataloader")
    if subject.dataloader is not None and loader_state is not None:
        schema.check_counts(loader_state, "checkpoint dataloader")
        check_loader = getattr(subject.dataloader, "check_state_dict", None)
        if check_loader is None:
            schema.check_like(
                loader_state, subject.dataloader.state_dict(), "checkpoint dataloader"
            )
        else:  # the engine's loader: a position saved at another world size may resume
            check_loader(loader_state, shared["world_size"], subject.comm.world_size)


def _read_rank_json(
    path: Path, rank: int, saved_world_size: int, manifest: dict[str, Any] | None
) -> dict[str, Any] | None:
    """This rank's random states; None when the checkpoint had fewer ranks than this run."""
    name = f"rank{rank}.json"
    file = path / name
    if rank >= saved_world_size:
        return None
    if not file.is_file():
        raise CheckpointError(
            f"'{file}' is missing: the checkpoint was saved by {saved_world_size} ranks and "
            "is incomplete"
        )
    if manifest is not None:
        checksums.check_small_file(path, name, manifest)
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"'{file}' is unreadable or corrupted: {error}") from None
    schema.check_rank_state(data, str(file))
    return data


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
