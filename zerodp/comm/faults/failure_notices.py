"""A rank that fails says so, so that the others name it instead of guessing.

[Note: failure notices]
When one rank fails (out of memory in a forward, an exception in the user's
code) the others find out only through its silence: a collective that waits,
then a connection the dead process closed, or at stage 3 a pass whose posts
no longer match ("rank 1 ends its forward pass"). Each of those is a guess
about a peer ("a peer died, froze, or issued a different collective", a
`DivergenceError`). So a failing rank posts a notice in the process group's
store (out of band, on the store that survives a rank's death under
torchrun) before it goes:

- `exit`: an exception nobody caught is ending the process (`sys.excepthook`,
  installed at set-up, chained to the one before it). The rank will never join
  another collective.
- a pass (`forward 3`): a stage 3 forward died part-way on this rank (see
  `zerodp.stage3.module_hooks`); it will not join the rest of that pass. If
  every rank failed there together and retries, the notice is stale: a rank
  reads it only while it has not begun a later pass of that kind.

A rank reads notices only where something is already wrong: every second a
collective waits (`CollectiveOrder.on_stall`), while a checked pass waits for
a peer's post, and when a collective fails. It then raises `PeerFailedError`,
naming the rank and its error, instead of the guess. Reading costs one store
round trip, and nothing at all while collectives complete.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch.distributed as dist

from zerodp.errors import CollectiveError, DivergenceError, PeerFailedError

logger = logging.getLogger("zerodp")

_PREFIX = "zerodp/failures/"
_COUNT = _PREFIX + "count"
EXIT = "exit"  # the kind of a notice posted by a process that is ending
_MESSAGE_CHARS = 500


@dataclass(frozen=True)
class FailureNotice:
    """What one rank posted about its failure."""

    rank: int
    kind: str  # EXIT, or the kind of the pass that died ("forward")
    number: int  # the pass's number (0 for the first of its kind); -1 for EXIT
    error: str  # "OutOfMemoryError: CUDA out of memory. ..."

    def describe(self) -> str:
        if self.kind == EXIT:
            return f"rank {self.rank} failed and is ending: {self.error}"
        return f"rank {self.rank} failed in its {self.kind} pass {self.number + 1}: {self.error}"

    def encode(self) -> str:
        return f"{self.kind} {self.number}\n{self.error}"

    @classmethod
    def decode(cls, rank: int, text: str) -> FailureNotice:
        head, _, error = text.partition("\n")
        kind, number = head.split()
        return cls(rank, kind, int(number), error)


def describe_error(error: BaseException) -> str:
    """`Type: first line of the message`, short enough for a store value and a log line."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > _MESSAGE_CHARS:
        first = first[:_MESSAGE_CHARS] + " ..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


_POSTED: list[FailureNotice] = []  # this process's own notices


def posted_any() -> bool:
    """Whether this process told the others it failed."""
    return bool(_POSTED)


class FailureBoard:
    """The notices of one namespace of the process group's store.

    The process's board (`process_board()`) takes `exit` notices; each collective order
    check has its own for pass notices, so that a notice from one engine's passes is never
    read against another engine's (pass numbers start again with every engine).
    """

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self._store = store
        self.rank = rank
        self.world_size = world_size

    def post(self, error: BaseException, kind: str = EXIT, number: int = -1) -> None:
        """Tell the other ranks that this one failed (never raises: it runs on the way out).

        Not for errors that are about other ranks (a failed collective, a divergence every
        rank raises): the rank to name is the one that failed first, and it posts its own.
        """
        if isinstance(error, (CollectiveError, DivergenceError)):
            return
        notice = FailureNotice(self.rank, kind, number, describe_error(error))
        _POSTED.append(notice)
        try:
            self._store.set(_PREFIX + str(self.rank), notice.encode())
            self._store.add(_COUNT, 1)
        except Exception:  # the store is gone too (its host died): the others will guess
            logger.debug("could not post a failure notice", exc_info=True)

    def read(self) -> list[FailureNotice]:
        """The notices the other ranks posted (never raises; empty if the store is gone)."""
        try:
            if int(self._store.add(_COUNT, 0)) == 0:
                return []
            notices = []
            for rank in range(self.world_size):
                key = _PREFIX + str(rank)
                if rank != self.rank and self._store.check([key]):
                    notices.append(FailureNotice.decode(rank, self._store.get(key).decode()))
            return notices
        except Exception:
            logger.debug("could not read failure notices", exc_info=True)
            return []


def process_board() -> FailureBoard | None:
    """The board of `exit` notices (None at world size 1 or without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
    return FailureBoard(store, dist.get_rank(), dist.get_world_size())


def read_exits() -> list[FailureNotice]:
    board = process_board()
    return [] if board is None else board.read()


def one_per_rank(notices: list[FailureNotice]) -> list[FailureNotice]:
    """The first notice of each rank (list pass notices first: they say more)."""
    seen: dict[int, FailureNotice] = {}
    for notice in notices:
        seen.setdefault(notice.rank, notice)
    return sorted(seen.values(), key=lambda notice: notice.rank)


_installed = threading.Lock()
_INSTALLED: list[bool] = []
_UNCAUGHT: list[str] = []  # the exception nobody caught, as the excepthook saw it


def ended_by_uncaught_exception() -> bool:
    """Whether an exception nobody caught (other than KeyboardInterrupt) is ending this
    process, so that its exit status is Python's 1."""
    return bool(_UNCAUGHT)


def install_excepthook() -> None:
    """Post an `exit` notice for an exception nobody caught, then report it as before."""
    with _installed:
        if _INSTALLED:
            return
        _INSTALLED.append(True)
        previous = sys.excepthook

        def hook(
            kind: type[BaseException], value: BaseException, trace: TracebackType | None
        ) -> None:
            interrupted = isinstance(value, KeyboardInterrupt)
            if not interrupted:
                _UNCAUGHT.append(kind.__name__)
            board = None if interrupted else process_board()
            if board is not None:
                board.post(value)
            previous(kind, value, trace)

        sys.excepthook = hook


def peer_failed_error(notices: list[FailureNotice], doing: str) -> PeerFailedError:
    """The error a rank raises when `notices` explain why `doing` cannot complete."""
    named = "; ".join(notice.describe() for notice in notices)
    return PeerFailedError(
        f"{named}. This rank ({dist.get_rank()}) stops: {doing} cannot complete without it. "
        "Fix that rank's error (its own traceback is in its output) and restart the job, "
        "resuming from the last checkpoint"
    )
