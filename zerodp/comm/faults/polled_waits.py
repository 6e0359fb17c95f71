"""Waiting for a collective while still hearing from the other ranks.

A rank waiting in a collective that another rank will never join would wait
until the process group's timeout (half an hour). The collective order check
([Note: collective order] in `zerodp.comm.faults.collective_order`) instead has every wait call
`on_stall` each `STALL_POLL_S` seconds it lasts, which may raise. gloo's
all-gather and all-reduce honour a timed `wait`; its reduce-scatter ignores
the timeout (it blocks until done) and has neither a future nor a working
`is_completed`. So a reduce-scatter is handed, when it is issued, to one
helper thread that waits for it (gloo runs collectives in issue order, so one
thread waiting in that order never waits on a later one first); the caller
later waits on an event, with the same polling. Handing it over at issue
rather than at the wait keeps the thread switch off the critical path: by the
time the reduction's result is needed the event is usually set already.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

STALL_POLL_S = 1.0
# The helper thread's stack: it only waits in a work's `wait()`. The default (the stack
# rlimit, 8 MiB) is private memory the process reserves, counted by RLIMIT_DATA.
_HELPER_STACK_BYTES = 512 * 1024

OnStall = Callable[[], None]


class WatchedWork:
    """A work the helper thread waits for; `wait(on_stall)` waits on its event."""

    __slots__ = ("done", "failed")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.failed: BaseException | None = None

    def wait(self, on_stall: OnStall) -> bool:
        """Wait for the work; whether the wait stalled (called `on_stall` at least once)."""
        stalled = False
        while not self.done.wait(STALL_POLL_S):
            stalled = True
            on_stall()
        if self.failed is not None:
            raise self.failed
        return stalled


def watch(work: Any) -> WatchedWork:
    """Start waiting for `work` (one that ignores a timed wait) on the helper thread."""
    return _HELPER.submit(work)


def wait_timed(work: Any, on_stall: OnStall) -> bool:
    """`work.wait()`, calling `on_stall()` every `STALL_POLL_S` seconds it lasts; whether
    it stalled."""
    timeout = datetime.timedelta(seconds=STALL_POLL_S)
    stalled = False
    while True:
        try:
            work.wait(timeout=timeout)
            return stalled
        except RuntimeError as error:
            if "timed out" not in str(error):
                raise
        stalled = True
        on_stall()


def stop_waiting_thread(timeout_s: float) -> bool:
    """Let the waiting thread finish what it holds and end; whether it ended in time.

    Called at interpreter exit (see [Note: ending the process] in zerodp.comm.faults.teardown):
    a thread still inside `work.wait()` when the interpreter finalizes aborts the process.
    """
    return _HELPER.stop(timeout_s)


class _WaitingThread:
    """One daemon thread that waits for works which ignore a timed wait, in issue order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, WatchedWork] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work: Any) -> WatchedWork:
        watched = WatchedWork()
        self._start()
        self._queue.put((work, watched))
        return watched

    def _start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="zerodp-collective-wait", daemon=True
                )
                # A process-wide setting for the threads started next: set for this one.
                previous = threading.stack_size(_HELPER_STACK_BYTES)
                try:
                    self._thread.start()
                finally:
                    threading.stack_size(previous)

    def stop(self, timeout_s: float) -> bool:
        with self._lock:
            thread = self._thread
            if thread is None or not thread.is_alive():
                return True
            self._queue.put(None)
        thread.join(timeout_s)
        return not thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # stop(): every item before it has been waited for
                return
            work, watched = item
            try:
                work.wait()
            except BaseException as error:  # handed to the waiting caller
                watched.failed = error
            finally:
                watched.done.set()
                # Hold no work between items: its last reference dropped here while the
                # interpreter finalizes aborts the process ([Note: ending the process]).
                del work, watched


_HELPER = _WaitingThread()
