"""The reports of a decoupled save, through the process group's store (see [Note: decoupled save]).

Each rank posts one `RankReport` when its files are written, fsynced and
checksummed (or why they are not); rank 0 collects every report, commits or not,
and posts the verdict, which every other rank reads and acknowledges. Every key
of one save lives under its own prefix (the save's temporary directory name, unique
per save) and rank 0 removes the keys once they are read.

The store is not a process group: reading and writing it from the writing thread
never meets a collective of the training, on any rank. A wait polls the store
until a deadline (the engine's collective timeout), and gives up at once when the
store itself is gone (its host process died). A rank whose script failed still
reports: its interpreter waits for the writing thread before it ends, so a
failure notice ([Note: failure notices]) is no reason to stop waiting for it.
"""

from __future__ import annotations

import json
import pickle
import time
from dataclasses import dataclass
from typing import Any

from zerodp.errors import AGREED_TYPES, CheckpointError

_PREFIX = "zerodp/decoupled_save/"
_FIRST_POLL_S = 0.01
_LONGEST_POLL_S = 0.1
_ACK_WAIT_S = 60.0  # rank 0 waits this long at most for the others to have read the verdict


@dataclass(frozen=True)
class RankReport:
    """One rank's part of a save: DCP's write results and the checksum entries of its files,
    or why its part failed."""

    rank: int
    results: list[Any]  # DCP's WriteResult of every chunk this rank wrote
    entries: dict[str, dict[str, Any]]  # checksum entries of the files this rank wrote
    error: CheckpointError | None = None


@dataclass(frozen=True)
class Verdict:
    """Rank 0's word on a save, the same on every rank: committed, or the error."""

    error: CheckpointError | None

    def encode(self) -> bytes:
        if self.error is None:
            return json.dumps({"error": None}).encode()
        return json.dumps({"type": type(self.error).__name__, "error": str(self.error)}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Verdict:
        value = json.loads(data.decode())
        if value.get("error") is None:
            return cls(None)
        kind = AGREED_TYPES.get(value.get("type", ""), CheckpointError)
        error = kind(value["error"])
        return cls(error if isinstance(error, CheckpointError) else CheckpointError(str(error)))


class ReportBoard:
    """The store keys of one save, as this rank reads and writes them."""

    def __init__(
        self, store: Any, save_name: str, rank: int, world_size: int, deadline_s: float
    ) -> None:
        self._store = store
        self._prefix = f"{_PREFIX}{save_name}/"
        self.rank = rank
        self.world_size = world_size
        self._deadline_s = deadline_s

    def _report_key(self, rank: int) -> str:
        return f"{self._prefix}report/{rank}"

    def post_report(self, report: RankReport) -> None:
        self._call(self._store.set, self._report_key(report.rank), pickle.dumps(report))

    def collect_reports(self) -> list[RankReport]:
        """Every rank's report, in rank order (rank 0), once all are posted."""
        keys = [self._report_key(rank) for rank in range(self.world_size)]
        self._wait_for(keys, "the ranks' reports that their files are written", self._deadline_s)
        reports = [pickle.loads(self._call(self._store.get, key)) for key in keys]
        for key in keys:
            self._delete(key)
        return reports

    def post_verdict(self, verdict: Verdict) -> None:
        """Rank 0: the verdict, then (bounded) wait until every other rank has read it, so
        that a store this process hosts outlives their reading."""
        self._call(self._store.set, f"{self._prefix}verdict", verdict.encode())
        acks = f"{self._prefix}acks"
        end = time.monotonic() + min(self._deadline_s, _ACK_WAIT_S)
        pause = _FIRST_POLL_S
        while int(self._call(self._store.add, acks, 0)) < self.world_size - 1:
            if time.monotonic() > end:
                break  # a rank that never reads it is gone; nothing more to do for it
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_POLL_S)
        self._delete(f"{self._prefix}verdict")
        self._delete(acks)

    def hear_verdict(self) -> Verdict:
        """Ranks other than 0: rank 0's verdict, acknowledged."""
        key = f"{self._prefix}verdict"
        self._wait_for([key], "rank 0's verdict on the save", self._deadline_s)
        verdict = Verdict.decode(self._call(self._store.get, key))
        self._call(self._store.add, f"{self._prefix}acks", 1)
        return verdict

    def _wait_for(self, keys: list[str], what: str, within_s: float) -> None:
        end = time.monotonic() + within_s
        pause = _FIRST_POLL_S
        while True:
            missing = [key for key in keys if not self._call(self._store.check, [key])]
            if not missing:
                return
            if time.monotonic() > end:
                raise CheckpointError(
                    f"waiting for {what}: {len(missing)} missing after {within_s:.0f} s "
                    f"({', '.join(k.removeprefix(self._prefix) for k in missing)}); a rank died "
                    "or froze, or comms_timeout_s is too short to write these files"
                )
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_POLL_S)

    def _delete(self, key: str) -> None:
        try:
            self._store.delete_key(key)
        except Exception:  # pragma: no cover - a store without deletion keeps a few bytes
            return

    def _call(self, method: Any, *args: Any) -> Any:
        try:
            return method(*args)
        except CheckpointError:
            raise
        except Exception as error:  # the store's host process is gone, or its link
            raise CheckpointError(
                f"the process group's store failed while ranks exchanged the save's reports "
                f"({type(error).__name__}: {error}); a rank died, the save was not committed"
            ) from None
