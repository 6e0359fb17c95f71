"""What one checkpoint save writes, fixed at the call: the request either writer carries out.

`prepare_save` makes every check on every rank and agrees on the verdict before
the first collective, so a bad path or tag is an error on every rank and no rank
is left waiting. It picks the tag and the temporary directory (rank 0 names it,
every rank hears it), and captures what is not a tensor as it is at the call:
the shared JSON as text and this rank's random states. `state_tensors` is the
save's DCP state dict (views of the engine's own buffers: a synchronous save
writes them at once, a decoupled one copies them to host memory first). The
synchronous writer (`save_load`) and the decoupled one (`writers`) both start here,
so both write the same checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerodp.checkpoint_io import checksums, json_state, tensor_slices, tensors, window_gradients
from zerodp.checkpoint_io.agreed import agreed
from zerodp.checkpoint_io.integrity import CHECKPOINT_FAILURES
from zerodp.checkpoint_io.jsonable import to_jsonable
from zerodp.checkpoint_io.paths import check_save_target, clean_leftovers, new_temp_name
from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.comm import Comm
from zerodp.errors import CheckpointError


@dataclass(frozen=True)
class SaveRequest:
    """One save: where it goes and everything in it that is not one of the engine's tensors."""

    directory: Path  # save_dir
    tag: str
    temp: Path  # the temporary directory it is written under (see zerodp.checkpoint_io.paths)
    shared_json: str  # zerodp_state.json, as it was at the call (written by rank 0)
    rank_json: str | None  # this rank's random states at the call; None: left out
    client_tensors: dict[str, Any]  # the tensors of client_state (rank 0 writes them)
    random_states: bool
    has_gradients: bool  # a window's kept gradients are saved

    @property
    def final(self) -> Path:
        return self.directory / self.tag

    @property
    def where(self) -> str:
        return f"saving checkpoint '{self.tag}' under '{self.directory}'"


def prepare_save(
    subject: CheckpointSubject,
    save_dir: Any,
    tag: str | None,
    client_state: Any,
    random_states: bool,
) -> SaveRequest:
    """Check, agree, name the temporary directory and make it (rank 0); see the module doc."""
    comm = subject.comm
    error: BaseException | None = None
    fixed: dict[str, Any] = {}
    try:
        fixed = _fixed_at_the_call(subject, save_dir, tag, client_state, random_states)
    except CHECKPOINT_FAILURES as caught:
        error = caught
    comm.raise_if_any_failed(error)
    temp_name = comm.broadcast_object(new_temp_name(fixed["tag"]) if comm.rank == 0 else None)
    request = SaveRequest(temp=fixed["directory"] / temp_name, **fixed)

    def make_temp() -> None:
        if comm.rank == 0:
            clean_leftovers(request.directory)  # what killed or failed saves left, ours only
            request.temp.mkdir(parents=True)

    try:
        agreed(comm, request.where, make_temp)
    except CheckpointError:
        abandon(comm, request.directory)
        raise
    return request


def _fixed_at_the_call(
    subject: CheckpointSubject,
    save_dir: Any,
    tag: str | None,
    client_state: Any,
    random_states: bool,
) -> dict[str, Any]:
    subject.check_idle()
    subject.before_save()
    directory = check_save_target(save_dir, tag)
    if tag is None:
        tag = f"global_step{subject.counters.state_dict()['global_steps']}"
    client_tensors: dict[str, Any] = {}
    client_json = to_jsonable({} if client_state is None else client_state, client_tensors)
    tensor_slices.check_can_save(subject)
    shared = json_state.shared_state(subject, client_json)
    shared["gradients"] = window_gradients.describe(subject)
    shared[tensor_slices.DIMS] = subject.dims.to_record()  # how saved parts combine at a load
    if subject.expert_slices:  # which tensors were this rank's experts only (their whole shapes
        shared[window_gradients.EXPERT_KEY] = sorted(subject.expert_slices)  # are in params)
    tp = tensor_slices.describe(subject)
    if tp is not None:
        shared[tensor_slices.KEY] = tp
    shared["random_states"] = random_states
    return {
        "directory": directory,
        "tag": tag,
        "shared_json": json_state.json_text(shared),
        "rank_json": json_state.json_text(json_state.rank_state()) if random_states else None,
        "client_tensors": client_tensors,
        "random_states": random_states,
        "has_gradients": shared["gradients"] is not None,
    }


def state_tensors(subject: CheckpointSubject, request: SaveRequest) -> dict[str, Any]:
    """The save's DCP state dict: views of the engine's tensors, the random generator states
    (read now) and, on rank 0, the client_state's tensors."""
    comm = subject.comm
    places = subject.places(saving=True)
    state: dict[str, Any] = {
        **tensors.model_tensors(subject, places),
        **tensors.master_tensors(subject, places),
        **tensors.optimizer_tensors(subject, places),
        **(tensors.rng_tensors(comm.rank) if request.random_states else {}),
    }
    if request.has_gradients:
        state.update(window_gradients.gradient_tensors(subject))
    if comm.rank == 0:
        state.update(request.client_tensors)
    return state


def json_files(request: SaveRequest, rank: int) -> dict[str, str]:
    """This rank's JSON files, by name: rank<r>.json (unless random states are left out);
    rank 0 also zerodp_state.json."""
    files = {} if request.rank_json is None else {f"rank{rank}.json": request.rank_json}
    if rank == 0:
        files[json_state.STATE_FILE] = request.shared_json
    return files


def write_json_files(request: SaveRequest, rank: int) -> dict[str, dict[str, Any]]:
    """This rank's JSON files under the temporary directory, written and fsynced; their
    checksum entries."""
    entries: dict[str, dict[str, Any]] = {}
    for name, text in json_files(request, rank).items():
        json_state.write_json_text(request.temp / name, text)
        entries[name] = checksums.small_file_entry(request.temp / name)
    return entries


def abandon(comm: Comm, directory: Path) -> None:
    """After a failed save, once no rank writes any more: rank 0 removes what it left."""
    if comm.rank == 0:
        clean_leftovers(directory)
