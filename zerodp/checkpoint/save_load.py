"""`save_checkpoint` and `load_checkpoint`: an engine's state through torch.distributed.checkpoint.

Both validate on every rank and agree on the verdict before the first
collective (see `Comm.raise_if_any_failed`), so a bad path or tag, or a
checkpoint for another model, is an error on every rank and no rank is left
waiting. A load checks everything it can know before reading a tensor
(checksums of every file, the model, the optimizer class and settings,
param-group count, every JSON value, every rank's generator states) and
changes nothing until every check has passed on every rank. Nothing is
unpickled from a checkpoint (`zerodp.checkpoint.safe_metadata`). Tensors
go through DCP (see `zerodp.checkpoint.tensors`); the rest is JSON
(`zerodp.checkpoint.json_state`). Saving is atomic (`zerodp.checkpoint.paths`)
and every failure of it, DCP's own included, is one `CheckpointError` with
the same message on every rank, after which the engine trains on.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from zerodp.checkpoint import (
    checksums,
    destinations,
    gradients,
    integrity,
    json_state,
    schema,
    tensor_slices,
    tensors,
)
from zerodp.checkpoint.jsonable import from_jsonable, to_jsonable
from zerodp.checkpoint.load_options import LoadOptions
from zerodp.checkpoint.paths import (
    check_load_source,
    check_save_target,
    clean_leftovers,
    commit,
    has_latest,
    new_temp_name,
)
from zerodp.checkpoint.safe_metadata import METADATA_FILE, SafeReader, read_metadata
from zerodp.checkpoint.sharded import quiet_sharded_tensor_warnings
from zerodp.checkpoint.subject import CheckpointSubject
from zerodp.comm import Comm
from zerodp.errors import CheckpointError, CheckpointStorageError, ZeroDPError

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
    """`random_states=False` leaves the random generator states out (they are not the run's:
    `zerodp convert`); a load then leaves the generators as they are."""
    comm = subject.comm
    error: BaseException | None = None
    directory = Path(".")
    shared: dict[str, Any] = {}
    client_tensors: dict[str, Any] = {}
    try:
        subject.check_idle()
        subject.before_save()
        directory = check_save_target(save_dir, tag)
        tag = (
            tag
            if tag is not None
            else f"global_step{subject.counters.state_dict()['global_steps']}"
        )
        client_json = to_jsonable({} if client_state is None else client_state, client_tensors)
        tensor_slices.check_can_save(subject)
        shared = json_state.shared_state(subject, client_json)
        shared["gradients"] = gradients.describe(subject)
        tp = tensor_slices.describe(subject)
        if tp is not None:
            shared[tensor_slices.KEY] = tp
        shared["random_states"] = random_states
        json.dumps(shared, allow_nan=True)
    except _FAILURES as caught:
        error = caught
    comm.raise_if_any_failed(error)
    if tag is None:  # pragma: no cover - set above on every rank
        raise RuntimeError("internal error: no tag")

    temp_name = comm.broadcast_object(new_temp_name(tag) if comm.rank == 0 else None)
    temp = directory / temp_name
    try:
        _write(subject, directory, temp, tag, shared, client_tensors, random_states)
    except CheckpointError:
        if comm.rank == 0:  # every rank has stopped writing: the agreement said so
            clean_leftovers(directory)
        raise
    return directory / tag


def _write(
    subject: CheckpointSubject,
    directory: Path,
    temp: Path,
    tag: str,
    shared: dict[str, Any],
    client_tensors: dict[str, Any],
    random_states: bool,
) -> None:
    """Write everything under `temp`, agreeing after each phase, then commit (rank 0)."""
    comm = subject.comm
    where = f"saving checkpoint '{tag}' under '{directory}'"

    def phase_zero() -> None:
        if comm.rank == 0:
            clean_leftovers(directory)  # what killed or failed saves left, ours only
            temp.mkdir(parents=True)

    _agreed(comm, where, phase_zero)
    entries: dict[str, dict[str, Any]] = {}
    written: list[Any] = []

    def write_tensors() -> None:
        places = subject.places(saving=True)
        state: dict[str, Any] = {
            **tensors.model_tensors(subject, places),
            **tensors.master_tensors(subject, places),
            **tensors.optimizer_tensors(subject, places),
            **(tensors.rng_tensors(comm.rank) if random_states else {}),
        }
        if shared.get("gradients") is not None:
            state.update(gradients.gradient_tensors(subject))
        if comm.rank == 0:
            state.update(client_tensors)
        writer = FileSystemWriter(str(temp), single_file_per_rank=True, sync_files=True)
        with quiet_sharded_tensor_warnings():
            written.append(dcp.save(state, storage_writer=writer, process_group=comm.group))

    _agreed(comm, where, write_tensors)

    def write_json_and_hash() -> None:
        if random_states:
            rank_file = f"rank{comm.rank}.json"
            json_state.write_json(temp / rank_file, json_state.rank_state())
            entries[rank_file] = checksums.small_file_entry(temp / rank_file)
        if comm.rank == 0:
            json_state.write_json(temp / json_state.STATE_FILE, shared)
            for name in (json_state.STATE_FILE, METADATA_FILE):
                entries[name] = checksums.small_file_entry(temp / name)
        chunks = checksums.chunks_by_file(written[0])
        for name in checksums.my_share(chunks, comm.rank, comm.world_size):
            entries[name] = checksums.data_file_entry(temp / name, chunks[name])

    _agreed(comm, where, write_json_and_hash)
    gathered = comm.all_gather_object(entries)

    def finish() -> None:
        if comm.rank == 0:
            files = {name: entry for part in gathered for name, entry in part.items()}
            checksums.write_manifest(temp, files)  # last: a directory with it is complete
            commit(directory, temp.name, tag)

    _agreed(comm, where, finish)


def _agreed(comm: Comm, where: str, work: Any) -> None:
    """Run `work` on every rank; any rank's failure is one CheckpointError on all of them."""
    error: BaseException | None = None
    try:
        work()
    except _FAILURES as caught:
        error = _as_checkpoint_error(caught, where)
    comm.raise_if_any_failed(error)


def _as_checkpoint_error(error: BaseException, where: str) -> CheckpointError:
    if isinstance(error, CheckpointError):
        return error
    cause = _root_cause(error)
    rank = _failed_rank(error)
    text = f"{'' if rank is None else f'on rank {rank}, '}{type(cause).__name__}: {cause}"
    advice = (
        "nothing was committed: the previous checkpoints and 'latest' are intact, the engine "
        "is unchanged and training can go on"
    )
    if isinstance(cause, OSError):
        return CheckpointStorageError(
            f"{where} failed ({text}); free space or fix the storage, or pass another "
            f"save_dir; {advice}"
        )
    return CheckpointError(f"{where} failed ({text}); {advice}")


def _failed_rank(error: BaseException) -> int | None:
    failures = getattr(error, "failures", None)
    return min(failures) if isinstance(failures, dict) and failures else None


def _root_cause(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's `CheckpointException`, else `error`."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            return _root_cause(inner)
    return error


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
    grads = gradients.GradientLoad()
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
        tensor_slices.check_matches(subject, shared)
        integrity.check_model(subject.module, shared)
        saved = integrity.saved_keys(metadata)
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
            grads = gradients.plan_load(subject, shared, saved, with_optimizer)
            wanted.update(grads.destinations)
            json_state.counters_to_load(shared, subject.accumulation_steps)  # a resize fits
        destinations.check_kinds(wanted, saved, metadata)
    except _FAILURES as caught:
        error = caught if isinstance(caught, ZeroDPError) else _unexpected(caught, path)
    comm.raise_if_any_failed(error)  # nothing has been changed yet, on any rank

    destinations.attach_planned_state(subject, planned)
    error = None
    try:
        with quiet_sharded_tensor_warnings():
            reader = SafeReader(path, metadata)
            dcp.load(wanted, storage_reader=reader, process_group=comm.group)
    except _FAILURES as caught:
        error = CheckpointError(f"reading checkpoint '{path}' failed: {_root_cause(caught)}")
    comm.raise_if_any_failed(error)

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
