"""The handle of an in-flight collective: waited for while still hearing from the other ranks.

A `Comm` collective issued with `async_op` returns a `Handle`; one the caller waits for at
once is waited for through a `Handle` too. Its `wait()` polls while it lasts (`on_stall`,
see `zerodp.comm.faults.polled_waits`), and a backend failure in it becomes a
`CollectiveError` naming the collective (`zerodp.comm.faults.collective_history`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerodp.comm.faults.collective_history import (
    CollectiveHistory,
    CollectiveRecord,
    passes_through,
)
from zerodp.comm.faults.polled_waits import OnStall, WatchedWork, wait_timed, watch


class Handle:
    """An in-flight collective; `wait()` blocks until its result may be read.

    With `on_stall`, a wait that lasts calls it every second (it may raise; see
    `zerodp.comm.faults.polled_waits`), and `on_recover` once a wait that stalled has
    completed. `timed`: the work honours a timed wait (gloo's reduce-scatter does not).
    """

    __slots__ = (
        "__weakref__",
        "_history",
        "_on_recover",
        "_on_stall",
        "_record",
        "_watched",
        "_work",
    )

    def __init__(
        self,
        work: Any = None,
        on_stall: OnStall | None = None,
        timed: bool = True,
        on_recover: Callable[[], None] | None = None,
    ) -> None:
        self._work = work
        self._on_stall = on_stall
        self._on_recover = on_recover
        # An untimed work that is watched is waited for by the helper thread from now on.
        self._watched: WatchedWork | None = (
            watch(work) if work is not None and on_stall is not None and not timed else None
        )
        self._record: CollectiveRecord | None = None
        self._history: CollectiveHistory | None = None

    def track(self, record: CollectiveRecord, history: CollectiveHistory) -> None:
        """Name the collective in a failure of `wait()` (see
        `zerodp.comm.faults.collective_history`)."""
        self._record, self._history = record, history

    def wait(self) -> None:
        if self._work is not None:
            stalled = False
            try:
                if self._on_stall is None:
                    self._work.wait()
                elif self._watched is not None:
                    stalled = self._watched.wait(self._on_stall)
                else:
                    stalled = wait_timed(self._work, self._on_stall)
            except RuntimeError as error:
                if self._history is None or self._record is None or passes_through(error):
                    raise  # zerodp's own (a divergence found while waiting), out of memory
                raise self._history.failed(self._record, error) from error
            self._work = None
            if self._history is not None and self._record is not None:
                self._history.finish(self._record)
            if stalled and self._on_recover is not None:
                self._on_recover()

    @property
    def done(self) -> bool:
        return self._work is None


DONE = Handle()  # what a collective that needed no communication returns
