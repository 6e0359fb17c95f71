"""One decoupled save's work after the call, on a thread of its own (see [Note: decoupled save]).

Every rank writes its data file from its host copy (`host_staging`), its JSON
files, fsyncs them and checksums them, then posts its report to the store
(`write_reports`). Rank 0 then collects every report and, if none failed,
claims the commit, writes DCP's `.metadata`, the checksum list and commits
(`paths.commit`: the directory renamed, `latest` replaced last), and posts the
verdict; the other ranks wait for it. So every rank's save ends with the same
verdict ([Note: one verdict per save]), and the thread touches no tensor of the
engine and calls no collective.

`on_write_step` is called at each step of this protocol (`WRITE_STEPS`); tests
replace it to stall the writer or to kill the process at one of them.
"""

from __future__ import annotations

import enum
import logging
import shutil
import threading
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from zerodp.checkpoint_io import checksums, json_state
from zerodp.checkpoint_io.agreed import as_checkpoint_error
from zerodp.checkpoint_io.host_staging import HostStagedPlanner
from zerodp.checkpoint_io.integrity import CHECKPOINT_FAILURES
from zerodp.checkpoint_io.paths import commit
from zerodp.checkpoint_io.safe_metadata import METADATA_FILE
from zerodp.checkpoint_io.save_request import SaveRequest, json_files
from zerodp.checkpoint_io.write_reports import RankReport, ReportBoard, Verdict
from zerodp.errors import CheckpointError

logger = logging.getLogger("zerodp")


class WriteState(enum.Enum):
    """Where one decoupled save is: its files being written, then committed or failed."""

    WRITING = "writing"
    COMMITTED = "committed"
    FAILED = "failed"


def _no_fault(step: str) -> None:
    return None


on_write_step: Callable[[str], None] = _no_fault
WRITE_STEPS = ("started", "data_written", "reported", "all_reported", "verdict")


class BackgroundSave:
    """The files of one save, written and committed while training goes on."""

    def __init__(
        self,
        request: SaveRequest,
        planner: HostStagedPlanner,
        storage: FileSystemWriter,
        plan: SavePlan,
        metadata: Metadata | None,
        board: ReportBoard,
    ) -> None:
        self.request = request
        self.state = WriteState.WRITING
        self.error: CheckpointError | None = None
        self._planner: HostStagedPlanner | None = planner
        self._storage = storage
        self._plan = plan
        self._metadata = metadata  # rank 0's: the global plan's metadata, finished at commit
        self._board = board
        self._thread = threading.Thread(
            target=self._run, name=f"zerodp-save-{request.tag}", daemon=False
        )

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        """Wait for the verdict (the thread's deadlines bound the wait)."""
        self._thread.join()

    def _run(self) -> None:
        """Every rank ends with rank 0's verdict; nothing escapes the thread."""
        try:
            self.error = self._verdict().error
        except BaseException as caught:  # the store's failures, and anything unforeseen
            self.error = as_checkpoint_error(caught, self._where("exchanging the reports"))
        self._planner = None  # the host copy goes now, if it is still here
        self.state = WriteState.FAILED if self.error is not None else WriteState.COMMITTED
        if self.error is not None:
            logger.error(
                "%s (raised at the next save_checkpoint, wait_for_checkpoint or destroy)",
                self.error,
            )

    def _verdict(self) -> Verdict:
        on_write_step("started")
        report = self._write_own_part()
        self._board.post_report(report)
        on_write_step("reported")
        if self._board.rank != 0:
            verdict = self._board.hear_verdict()
        else:
            try:
                verdict = self._commit_or_not()
            except CHECKPOINT_FAILURES as caught:
                verdict = Verdict(as_checkpoint_error(caught, self._where("collecting reports")))
            # Whatever it is, the others wait for it; a rank that gave up first decided it.
            verdict = self._board.post_verdict(verdict)
        on_write_step("verdict")
        return verdict

    def _write_own_part(self) -> RankReport:
        rank, temp = self._board.rank, self.request.temp
        prefix = getattr(self._plan.storage_data, "prefix", f"__{rank}_")
        planner, self._planner = self._planner, None
        try:
            if planner is None:
                raise RuntimeError("internal error: a decoupled save was written twice")
            future = self._storage.write_data(self._plan, planner)
            future.wait()
            results = list(future.value())
        except CHECKPOINT_FAILURES as caught:
            # One file per rank: DCP's single_file_per_rank with one writing thread.
            where = self._where(f"writing its data file '{temp / prefix}0{DEFAULT_SUFFIX}'")
            return RankReport(rank, [], {}, as_checkpoint_error(caught, where))
        finally:
            del planner  # the host copy is written: freed before the others are waited for
        on_write_step("data_written")
        entries: dict[str, dict[str, Any]] = {}
        doing = ""
        try:
            for name, text in json_files(self.request, rank).items():
                doing = f"writing '{temp / name}'"
                json_state.write_json_text(temp / name, text)
                entries[name] = checksums.small_file_entry(temp / name)
            for name, chunks in _chunks_by_file(results).items():
                doing = f"checksumming '{temp / name}'"
                entries[name] = checksums.data_file_entry(temp / name, chunks)
        except CHECKPOINT_FAILURES as caught:
            return RankReport(rank, [], {}, as_checkpoint_error(caught, self._where(doing)))
        return RankReport(rank, results, entries)

    def _commit_or_not(self) -> Verdict:
        """Rank 0: every report in; the first failure is the verdict, else commit."""
        reports = self._board.collect_reports()
        on_write_step("all_reported")
        failed = [r for r in reports if r.error is not None]
        if failed:
            shutil.rmtree(self.request.temp, ignore_errors=True)  # no rank writes any more
            return Verdict(failed[0].error)
        if self._metadata is None:
            raise RuntimeError("internal error: rank 0 has no plan metadata to commit")
        gave_up = self._board.claim_commit()  # [Note: one verdict per save]
        if gave_up is not None:
            return gave_up  # a rank stopped waiting before the commit began: nothing renamed
        request = self.request
        try:
            self._storage.finish(self._metadata, [r.results for r in reports])
            files = {name: entry for r in reports for name, entry in r.entries.items()}
            files[METADATA_FILE] = checksums.small_file_entry(request.temp / METADATA_FILE)
            checksums.write_manifest(request.temp, files)  # last: a directory with it is complete
            commit(request.directory, request.temp.name, request.tag)
        except CHECKPOINT_FAILURES as caught:
            where = self._where(f"committing '{request.temp}' as '{request.final}'")
            return Verdict(as_checkpoint_error(caught, where))
        return Verdict(None)

    def _where(self, what: str) -> str:
        request = self.request
        return (
            f"the decoupled save of checkpoint '{request.tag}' under '{request.directory}' "
            f"(rank {self._board.rank}, {what})"
        )


def _chunks_by_file(results: list[Any]) -> dict[str, list[tuple[int, int, str]]]:
    """For each data file this rank wrote, its chunks as (offset, length, tensor key)."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for result in results:
        info = result.storage_data
        out.setdefault(info.relative_path, []).append(
            (int(info.offset), int(info.length), result.index.fqn)
        )
    for chunks in out.values():
        chunks.sort()
    return out
