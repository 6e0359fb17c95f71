"""Waiting for a collective while still hearing from the other ranks.

A rank waiting in a collective that another rank will never join would wait
until the process group's timeout (half an hour). The collective order check
([Note: collective order] in `zerodp.comm.order`) instead has every wait call
`on_stall` each `STALL_POLL_S` seconds it lasts, which may raise. gloo's
all-gather and all-reduce honour a timed `wait`; its reduce-scatter ignores
the timeout (it blocks until done), so those are waited for by one helper
thread while the caller waits on an event, with the same polling.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

STALL_POLL_S = 1.0

OnStall = Callable[[], None]


def wait_watched(work: Any, on_stall: OnStall, *, timed: bool) -> None:
    """`work.wait()`, calling `on_stall()` every `STALL_POLL_S` seconds it lasts."""
    if not timed:
        _HELPER.wait(work, on_stall)
        return
    timeout = datetime.timedelta(seconds=STALL_POLL_S)
    while True:
        try:
            work.wait(timeout=timeout)
            return
        except RuntimeError as error:
            if "timed out" not in str(error):
                raise
        on_stall()


class _WaitingThread:
    """One daemon thread that waits for works which ignore a timed wait, one after another."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, threading.Event, list[BaseException]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def wait(self, work: Any, on_stall: OnStall) -> None:
        done = threading.Event()
        failed: list[BaseException] = []
        self._start()
        self._queue.put((work, done, failed))
        while not done.wait(STALL_POLL_S):
            on_stall()
        if failed:
            raise failed[0]

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="zerodp-collective-wait", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            work, done, failed = self._queue.get()
            try:
                work.wait()
            except BaseException as error:  # handed to the waiting caller
                failed.append(error)
            finally:
                done.set()


_HELPER = _WaitingThread()
