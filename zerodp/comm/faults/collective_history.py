"""The last collectives this rank issued, so that a failed one is an error that names it.

A frozen or dead peer shows up on the other ranks as a gloo/NCCL
`RuntimeError` ("Timed out waiting 10000ms for recv", "Connection closed by
peer") that says nothing about which of zerodp's collectives it was in. Every
`Comm` collective is `recorded`: the history keeps the last few (kind, bytes,
the zerodp call site that issued it), and a failure becomes a
`CollectiveError` naming the collective, how long it waited, and the ones
before it; the same text goes to the `zerodp` logger (stderr by default).
Recording is a few attribute writes per collective, not a synchronisation.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any, TypeVar

import torch

from zerodp.errors import CollectiveError, ZeroDPError

logger = logging.getLogger("zerodp")

_KEPT = 8
_PACKAGE = str(Path(__file__).resolve().parents[2])
_COMM = str(Path(__file__).resolve().parents[1])  # zerodp/comm, failure handling included


@dataclass
class CollectiveRecord:
    number: int  # 1, 2, ... on this rank
    kind: str
    nbytes: int | None
    caller: tuple[CodeType, int] | None  # the caller's code and line; formatted only if shown
    started: float
    finished: float | None = None

    @property
    def site(self) -> str:
        """The caller of the collective: file:line function."""
        return _format_site(self.caller)

    def describe(self, now: float) -> str:
        size = "" if self.nbytes is None else f", {_size(self.nbytes)}"
        if self.finished is None:
            state = f"waiting {now - self.started:.1f} s"
        else:
            state = f"done in {self.finished - self.started:.3f} s"
        return f"#{self.number} {self.kind}{size} from {self.site} ({state})"


class CollectiveHistory:
    """The last `_KEPT` collectives of one `Comm` on this rank."""

    def __init__(
        self,
        rank: int,
        on_failure: Callable[[], None] | None = None,
        explain: Callable[[str], CollectiveError | None] | None = None,
    ) -> None:
        self.rank = rank
        # What other ranks said about a failure: `Comm.explain_failure`.
        self.explain = explain
        self.count = 0
        self.records: deque[CollectiveRecord] = deque(maxlen=_KEPT)
        self.on_failure = on_failure  # the process group is unusable: the Comm aborts it
        self.broken: str | None = None  # the first failure, once there was one

    def issue(self, kind: str, nbytes: int | None) -> CollectiveRecord:
        self.count += 1
        record = CollectiveRecord(self.count, kind, nbytes, _caller(), time.monotonic())
        self.records.append(record)
        return record

    @staticmethod
    def finish(record: CollectiveRecord) -> None:
        record.finished = time.monotonic()

    def failed(self, record: CollectiveRecord, error: BaseException) -> CollectiveError:
        """The error to raise for `record`'s failure (and log it with the history).

        A `PeerFailedError` naming the rank that failed when one posted a notice, an
        `UnevenInputsError` when another rank posted that it is elsewhere.
        """
        now = time.monotonic()
        recent = "\n".join(f"  {r.describe(now)}" for r in self.records)
        message = (
            f"rank {self.rank}: collective {record.kind} #{record.number} (from {record.site}) "
            f"failed after {now - record.started:.1f} s: {str(error).strip()}\n"
            "A peer process died, froze, or issued a different collective (every rank must "
            "make the same zerodp calls in the same order). The wait is bounded by "
            "comms_timeout_s in the config (or $ZERODP_COMMS_TIMEOUT_S). This rank's last "
            f"collectives:\n{recent}"
        )
        place = f"{record.kind} #{record.number} (from {record.site})"  # as `waiting_in`
        doing = f"collective {place}"
        explained = self.explain(place) if self.explain is not None else None
        if self.broken is None:
            self.broken = doing
            if self.on_failure is not None:
                self.on_failure()
        if explained is not None:  # another rank said why: name it first
            logger.error("rank %d: %s", self.rank, explained)
            return explained
        logger.error("%s", message)
        return CollectiveError(message)

    def mark_broken(self, why: str) -> None:
        """The group is about to be aborted for `why`: nothing more is issued on it."""
        if self.broken is None:
            self.broken = why

    def waiting_in(self) -> str:
        """The collective this rank waits in: its oldest unfinished one."""
        for record in self.records:
            if record.finished is None:
                return f"{record.kind} #{record.number} (from {record.site})"
        return "a collective"

    def refuse_if_broken(self, kind: str) -> None:
        """After a failure nothing more is issued: the group is aborted, a peer is gone."""
        if self.broken is not None:
            raise CollectiveError(
                f"rank {self.rank}: collective {kind} not issued: {self.broken} failed "
                "earlier and its process group was aborted (a peer died or froze); restart "
                "the job, resuming from the last checkpoint"
            )


F = TypeVar("F", bound=Callable[..., Any])

_OUT_OF_MEMORY = ("can't allocate memory", "out of memory")


def passes_through(error: RuntimeError) -> bool:
    """Errors a collective raises that are not about its peers, so not a `CollectiveError`:
    zerodp's own, and this rank running out of memory (inside the backend's buffers too),
    which the message "a peer process died" would misname."""
    if isinstance(error, (ZeroDPError, torch.OutOfMemoryError)):
        return True
    text = str(error).lower()
    return any(marker in text for marker in _OUT_OF_MEMORY)


def recorded(kind: str) -> Callable[[F], F]:
    """Record a `Comm` method's collective in `self.history`; a backend failure in it (or in
    the wait of the handle it returns) becomes a `CollectiveError` that names it."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.world_size == 1:
                return method(self, *args, **kwargs)
            history: CollectiveHistory = self.history
            history.refuse_if_broken(kind)
            label = getattr(self, "label", "world")
            named = kind if label == "world" else f"{kind} in the {label} group"
            record = history.issue(named, _nbytes(args))
            try:
                result = method(self, *args, **kwargs)
            except RuntimeError as error:
                if passes_through(error):
                    raise
                raise history.failed(record, error) from error
            track = getattr(result, "track", None)
            if track is not None and not result.done:
                track(record, history)
            else:
                history.finish(record)
            return result

        return run  # type: ignore[return-value]

    return wrap


def _nbytes(args: tuple[Any, ...]) -> int | None:
    """The bytes of the largest tensor argument (the full tensor of the collective)."""
    sizes = [a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)]
    return max(sizes) if sizes else None


def _caller() -> tuple[CodeType, int] | None:
    """The first frame outside zerodp/comm (the zerodp or user code that asked): its code
    and line only, so that no frame (and none of its locals) is kept alive."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_COMM):
        frame = frame.f_back  # type: ignore[assignment]
    return None if frame is None else (frame.f_code, frame.f_lineno)


def _format_site(caller: tuple[CodeType, int] | None) -> str:
    if caller is None:  # pragma: no cover
        return "?"
    code, line = caller
    name = code.co_filename
    shown = name.removeprefix(_PACKAGE + "/") if name.startswith(_PACKAGE) else Path(name).name
    if name.startswith(_PACKAGE):
        shown = "zerodp/" + shown
    return f"{shown}:{line} {code.co_name}"


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return f"{nbytes} B"  # pragma: no cover
