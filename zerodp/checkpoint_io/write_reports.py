"""The reports of a decoupled save, through the process group's store (see [Note: decoupled save]).

Each rank posts one `RankReport` when its files are written, fsynced and
checksummed (or why they are not); rank 0 collects every report, commits or not,
and posts the verdict, which every other rank reads and acknowledges. Every key
of one save lives under its own prefix (the save's temporary directory name, unique
per save). The messages are JSON (`report_messages`): nothing read from the store
is unpickled.

[Note: one verdict per save]
Every rank ends a save with the same verdict, whatever the timing:

- Rank 0 waits for the reports at most D (the engine's collective timeout) from
  the end of its own write. A rank other than 0 waits for the verdict longer
  (`verdict_wait_s`: 2 D and a margin, from the end of its own write), so it does
  not give up while rank 0, whose write may end up to D after its own, still
  waits for a slower rank within D.
- The verdict key is set once, first come first served (the store's
  `compare_set`): rank 0 claims the commit (`claim_commit`) before it renames
  anything, then replaces the claim with the commit's outcome; or it sets its
  failure. A rank that waited `verdict_wait_s` in vain sets that it gave up,
  unless rank 0 claimed the commit first (then it waits, at most D more, for
  the commit to end). So a rank's giving up is the verdict of every rank, rank
  0's included (it commits nothing), and it can never happen after a commit began.
- The verdict stays readable until every rank (rank 0 too) has acknowledged it;
  the last to do so removes every key of the save, the reports of ranks that
  reported after rank 0's deadline included. A rank that reports late reads
  that verdict at once (the error rank 0 decided without it) instead of
  waiting in vain while the other ranks sit in a collective.

The store is not a process group: reading and writing it from the writing thread
never meets a collective of the training, on any rank. A wait polls the store
until its deadline, and gives up at once when the store itself is gone (its host
process died). A rank whose script failed still reports: its interpreter waits
for the writing thread before it ends, so a failure notice ([Note: failure
notices]) is no reason to stop waiting for it.
"""

from __future__ import annotations

import time
from typing import Any

from zerodp.checkpoint_io.report_messages import RankReport, Verdict
from zerodp.errors import CheckpointError

__all__ = ["RankReport", "ReportBoard", "Verdict", "verdict_wait_s"]

_PREFIX = "zerodp/decoupled_save/"
_FIRST_POLL_S = 0.01
_LONGEST_POLL_S = 0.1
_ACK_WAIT_S = 60.0  # rank 0 waits this long at most for the others to have read the verdict
_COMMITTING = b'{"committing": true}'  # the verdict key while rank 0 commits


def verdict_wait_s(deadline_s: float) -> float:
    """How long a rank other than 0 waits for the verdict from the end of its own write:
    rank 0's write may end up to `deadline_s` (D) after it, and rank 0 then waits up to D
    for the reports; the margin is for the commit itself."""
    return 2 * deadline_s + min(deadline_s, _ACK_WAIT_S)


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
        self._claimed = False  # rank 0: the verdict key holds its claim of the commit

    def _report_key(self, rank: int) -> str:
        return f"{self._prefix}report/{rank}"

    @property
    def _verdict_key(self) -> str:
        return f"{self._prefix}verdict"

    def post_report(self, report: RankReport) -> None:
        self._call(self._store.set, self._report_key(report.rank), report.encode())

    def collect_reports(self) -> list[RankReport]:
        """Every rank's report, in rank order (rank 0), once all are posted; a rank that gave
        up waiting first ends the wait with its verdict's error (the save's)."""
        keys = [self._report_key(rank) for rank in range(self.world_size)]
        self._wait_for(keys, "the ranks' reports that their files are written", self._deadline_s)
        return [RankReport.decode(self._call(self._store.get, key)) for key in keys]

    def claim_commit(self) -> Verdict | None:
        """Rank 0, every report in and none failed: claim the commit before anything is
        renamed. None: claimed (no rank can give up now; `post_verdict` ends it); else the
        verdict a rank that gave up set first, which is this save's."""
        stored = self._call(self._store.compare_set, self._verdict_key, "", _COMMITTING)
        if stored == _COMMITTING:
            self._claimed = True
            return None
        return Verdict.decode(stored)

    def post_verdict(self, verdict: Verdict) -> Verdict:
        """Rank 0: `verdict`, unless a rank that gave up set one first; the save's verdict,
        returned. Then (bounded) wait until every other rank has read it, so that a store
        this process hosts outlives their reading."""
        expected = _COMMITTING if self._claimed else ""
        stored = self._call(self._store.compare_set, self._verdict_key, expected, verdict.encode())
        final = Verdict.decode(stored)
        self._acknowledge()
        end = time.monotonic() + min(self._deadline_s, _ACK_WAIT_S)
        pause = _FIRST_POLL_S
        while self._call(self._store.check, [self._verdict_key]):  # removed once all read it
            if time.monotonic() > end:
                break  # a rank that never reads it is late or gone; the key waits for it
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_POLL_S)
        return final

    def hear_verdict(self) -> Verdict:
        """Ranks other than 0: the save's verdict, acknowledged. An existing one at once (a
        rank that reported after rank 0's deadline); else after `verdict_wait_s` this rank
        gives up, which is the verdict unless rank 0 claimed the commit first."""
        within = verdict_wait_s(self._deadline_s)
        value = self._poll_verdict(within)
        if value is None:
            gave_up = Verdict(
                CheckpointError(
                    f"rank {self.rank} gave up waiting for rank 0's verdict on the save after "
                    f"{within:.0f} s from the end of its own write (twice comms_timeout_s and a "
                    "margin): rank 0 died or froze, or the ranks' writes ended too far apart "
                    "for comms_timeout_s; nothing was committed: the previous checkpoints and "
                    "'latest' are intact"
                )
            )
            value = self._call(self._store.compare_set, self._verdict_key, "", gave_up.encode())
        if value == _COMMITTING:  # rank 0 began the commit before this rank gave up
            value = self._poll_verdict(self._deadline_s)
            if value is None or value == _COMMITTING:
                raise CheckpointError(
                    f"rank 0 began committing the save and gave no verdict within "
                    f"{self._deadline_s:.0f} s (comms_timeout_s): its storage froze; 'latest' "
                    "may or may not name the new checkpoint (rank 0's log says which)"
                )
        verdict = Verdict.decode(value)
        self._acknowledge()
        return verdict

    def _poll_verdict(self, within_s: float) -> bytes | None:
        """The verdict once posted; at the deadline what the key holds (None: nothing yet,
        or rank 0's claim of the commit). It is never removed before this rank read it."""
        end = time.monotonic() + within_s
        pause = _FIRST_POLL_S
        while True:
            value = None
            if self._call(self._store.check, [self._verdict_key]):
                value = self._call(self._store.get, self._verdict_key)
                if value != _COMMITTING:
                    return bytes(value)
            if time.monotonic() > end:
                return value
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_POLL_S)

    def _acknowledge(self) -> None:
        """This rank has the verdict; the last of all ranks to say so removes every key of
        the save (nobody reads any of them any more: every rank reported before it heard)."""
        acks = f"{self._prefix}acks"
        if int(self._call(self._store.add, acks, 1)) < self.world_size:
            return
        for key in [self._report_key(r) for r in range(self.world_size)]:
            self._delete(key)
        self._delete(self._verdict_key)
        self._delete(acks)

    def _wait_for(self, keys: list[str], what: str, within_s: float) -> None:
        end = time.monotonic() + within_s
        pause = _FIRST_POLL_S
        while True:
            missing = [key for key in keys if not self._call(self._store.check, [key])]
            if not missing:
                return
            if self._call(self._store.check, [self._verdict_key]):  # a rank gave up first
                error = Verdict.decode(self._call(self._store.get, self._verdict_key)).error
                if error is not None:
                    raise error
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
