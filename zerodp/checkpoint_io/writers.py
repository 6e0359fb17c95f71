"""The checkpoint writer an engine saves with: synchronous, or decoupled from training.

The config's `checkpoint.writer.decoupled` (DeepSpeed's key) picks one, once,
at construction (`writer_for`). Both take the same `SaveRequest`
(`zerodp.checkpoint_io.save_request`) and write the same checkpoint; they differ
in when `save_checkpoint` returns.

[Note: decoupled save]
`save_checkpoint` returns once this rank's part of the state is copied to host
memory; the files are written by a thread while training goes on, and
`latest` names the checkpoint only once every rank's files are durable.

- At the call (main thread, every rank, like any save): wait for the previous
  decoupled save and raise its error if it failed; check and agree
  (`prepare_save`); plan with DCP's planner (two object collectives: the local
  plans to every rank, rank 0's global plan back); copy the data of the items
  this rank writes, and nothing else, to host memory (`host_staging`: one
  copy, pinned when it comes from an accelerator); agree that every rank has
  its copy. Every collective of the save happens here, in the order every
  rank calls `save_checkpoint`, so none can meet a collective of training.
- In the background (one thread per save, `background_save`): write the data
  file and JSON files (fsynced), checksum them, post a report to the process
  group's store; rank 0 collects every report, writes DCP's `.metadata` and
  the checksum list, commits ([Note: atomic commit]: `latest` replaced last)
  and posts the verdict, which every other rank waits for. The store is not a
  process group: no collective runs off the main thread, and every rank's
  save ends with the same verdict, the error included, whatever the timing
  ([Note: one verdict per save] in `write_reports`).
- A second save, `wait_for_checkpoint()`, a load and `destroy()` wait for the
  verdict first; the first three agree on it (a collective, as they already
  are), so a failure is one `CheckpointError` with the same message on every
  rank, naming the file and the rank. At most one save is in flight: host
  memory holds at most one copy of the state.
- The thread is not a daemon: the interpreter waits for it before it runs
  the exit handlers (zerodp's among them: [Note: ending the process]), so
  the end of a script waits for its last save. A failure nobody waited for
  is logged by the thread as it ends, and once more at exit.
- A process killed at any point leaves every earlier checkpoint and `latest`
  as they were (the commit is rank 0's last step); the next save removes
  the temporary directory it left.

A thread, not a process: the host copy is already in this process, so a
thread writes it with no second copy or transfer, ends with the process (a
killed run leaves no orphan writer), and shares nothing a second interpreter
would have to be started, fed and watched for. The writing itself (file
writes, fsync, hashing) spends most of its time outside the GIL.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from zerodp.checkpoint_io.agreed import agreed
from zerodp.checkpoint_io.background_save import BackgroundSave, WriteState
from zerodp.checkpoint_io.host_staging import HostBuffers, HostStagedPlanner
from zerodp.checkpoint_io.save_load import save_checkpoint
from zerodp.checkpoint_io.save_request import SaveRequest, abandon, prepare_save, state_tensors
from zerodp.checkpoint_io.sharded import quiet_sharded_tensor_warnings
from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.checkpoint_io.write_reports import ReportBoard
from zerodp.comm import Comm, default_store
from zerodp.errors import CheckpointError

logger = logging.getLogger("zerodp")


class CheckpointWriter(Protocol):
    """How an engine's `save_checkpoint` writes, and waits for what it wrote."""

    def save(
        self,
        subject: CheckpointSubject,
        save_dir: Any,
        tag: str | None,
        client_state: Any,
        random_states: bool,
    ) -> Path: ...

    def wait(self, comm: Comm) -> Path | None:
        """Every rank: wait until the last save is committed (its path; None if there is
        none, or it failed); raise its error on every rank, once."""
        ...

    def close(self) -> None:
        """This rank: wait for the last save; raise its error if nobody has yet."""
        ...


class SynchronousWriter:
    """Writes and commits before `save` returns: nothing is ever pending."""

    def save(
        self,
        subject: CheckpointSubject,
        save_dir: Any,
        tag: str | None,
        client_state: Any,
        random_states: bool,
    ) -> Path:
        return save_checkpoint(subject, save_dir, tag, client_state, random_states=random_states)

    def wait(self, comm: Comm) -> Path | None:
        return None

    def close(self) -> None:
        return None


class DecoupledWriter:
    """Returns from `save` once the state is in host memory; see [Note: decoupled save]."""

    def __init__(self, deadline_s: float) -> None:
        self._deadline_s = deadline_s  # how long the background waits for the other ranks
        self._pending: BackgroundSave | None = None
        self._buffers = HostBuffers()  # one host copy, reused by every save
        self._reported = True  # whether the pending save's verdict reached the caller
        _UNCOLLECTED.add(self)

    def save(
        self,
        subject: CheckpointSubject,
        save_dir: Any,
        tag: str | None,
        client_state: Any,
        random_states: bool,
    ) -> Path:
        comm = subject.comm
        self.wait(comm)
        request = prepare_save(subject, save_dir, tag, client_state, random_states)
        try:
            job = self._stage(subject, request)
        except CheckpointError:
            abandon(comm, request.directory)  # every rank has stopped: agreed
            raise
        self._pending, self._reported = job, False
        job.start()
        return request.final

    def _stage(self, subject: CheckpointSubject, request: SaveRequest) -> BackgroundSave:
        """Plan (collectives, every rank) and copy this rank's items to host memory."""
        comm = subject.comm
        planner = HostStagedPlanner(self._buffers)
        storage = FileSystemWriter(str(request.temp), single_file_per_rank=True, sync_files=True)
        planned: dict[str, Any] = {}

        def plan_locally() -> None:
            with quiet_sharded_tensor_warnings():
                planner.set_up_planner(
                    state_tensors(subject, request),
                    storage_meta=storage.storage_meta(),
                    is_coordinator=comm.rank == 0,
                )
                storage.set_up_storage_writer(comm.rank == 0, rank=comm.rank)
                planned["local"] = storage.prepare_local_plan(planner.create_local_plan())

        agreed(comm, request.where, plan_locally)
        central = _central_plans(comm, planner, storage, request, planned["local"])

        def stage() -> None:
            planned["final"] = planner.finish_plan(central[0])
            planner.stage(planned["final"])

        agreed(comm, request.where, stage)
        store = default_store()
        board = ReportBoard(store, request.temp.name, comm.rank, comm.world_size, self._deadline_s)
        logger.debug(
            "checkpoint '%s': %d bytes copied to host memory on rank %d",
            request.tag,
            planner.staged_bytes,
            comm.rank,
        )
        return BackgroundSave(request, planner, storage, planned["final"], central[1], board)

    def wait(self, comm: Comm) -> Path | None:
        job = self._pending
        error: CheckpointError | None = None
        if job is not None:
            job.join()
            error = self._take_error(job)
        comm.raise_if_any_failed(error)
        if job is None or job.state is not WriteState.COMMITTED:
            return None
        return job.request.final

    def close(self) -> None:
        job = self._pending
        self._buffers = HostBuffers()  # the host copy is no longer needed once written
        if job is None:
            return
        job.join()
        error = self._take_error(job)
        if error is not None:
            raise error

    def _take_error(self, job: BackgroundSave) -> CheckpointError | None:
        """The verdict's error, handed to the caller once (later waits see it no more)."""
        if job.state is WriteState.WRITING:
            raise RuntimeError("internal error: a decoupled save ended without a verdict")
        reported, self._reported = self._reported, True
        return None if reported else job.error

    def uncollected_error(self) -> CheckpointError | None:
        job = self._pending
        if job is None or self._reported or job.state is WriteState.WRITING:
            return None
        return job.error


def _central_plans(
    comm: Comm,
    planner: HostStagedPlanner,
    storage: FileSystemWriter,
    request: SaveRequest,
    local: SavePlan,
) -> tuple[SavePlan, Metadata | None]:
    """(this rank's plan from rank 0's global plan, and rank 0's metadata for the commit)."""
    plans = comm.all_gather_object(local)
    made: dict[str, Any] = {"plans": None, "metadata": None}

    def plan_globally() -> None:
        if comm.rank == 0:
            global_plans, made["metadata"] = planner.create_global_plan(plans)
            made["plans"] = storage.prepare_global_plan(global_plans)

    agreed(comm, request.where, plan_globally)
    everyone = comm.broadcast_object(made["plans"])
    return everyone[comm.rank], made["metadata"]


def writer_for(decoupled: bool, deadline_s: float) -> CheckpointWriter:
    """The writer the config asks for (`checkpoint.writer.decoupled`)."""
    return DecoupledWriter(deadline_s) if decoupled else SynchronousWriter()


_UNCOLLECTED: weakref.WeakSet[DecoupledWriter] = weakref.WeakSet()


@atexit.register
def _log_uncollected() -> None:
    """At exit (after the interpreter waited for every writing thread): say once more what
    failed and was never raised, so that no failed save goes unnoticed."""
    for writer in list(_UNCOLLECTED):
        error = writer.uncollected_error()
        if error is not None:
            logger.error(
                "zerodp: a decoupled checkpoint save failed and the script ended without "
                "waiting for it (call engine.wait_for_checkpoint() or engine.destroy() at the "
                "end of training): %s",
                error,
            )
