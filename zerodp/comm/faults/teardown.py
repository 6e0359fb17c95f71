"""Ending a process that used zerodp, in an order that cannot abort the interpreter.

[Note: ending the process]
gloo runs each collective on a worker thread of its own. The caller sees the
work complete, but the worker drops its reference to the work (and to the
work's tensors) a moment later. When that reference is the last one to a
tensor that Python created, dropping it decrements a Python object, which
needs the GIL. Once the interpreter has begun to finalize, a thread that asks
for the GIL is ended by `pthread_exit`, and that forced unwind through gloo's
`noexcept` frames calls `std::terminate`: "terminate called without an active
exception", SIGABRT, exit status 134 instead of the script's. The window is
the time between the main thread's last collective and interpreter exit, which
is short on a quiet machine and long on a busy one, so a failing run (which
exits right after its last collective) ended by SIGABRT "sometimes". zerodp's
waiting thread (`zerodp.comm.faults.polled_waits`), blocked in `work.wait()` with the GIL
released, hits the same wall when it wakes during finalization.

So zerodp registers `end_collectives` with `atexit` (atexit handlers run
before finalization, while other threads may still take the GIL) and there:

0. posts that the script ended, with its step counts, unless it failed: a
   rank still waiting for this one reports uneven inputs ([Note: uneven
   inputs] in `zerodp.comm.faults.uneven_inputs`);
1. aborts each process group that still has a zerodp collective in flight or
   whose collective failed: nothing will read those results, and a peer that
   died or froze would never complete them (an abort makes them fail at once);
2. stops the waiting thread (its pending waits return once the group aborted);
3. destroys the process groups. The group's destructor drains gloo's queue and
   joins its worker threads with the GIL released, so every worker finishes
   its last work while the interpreter is whole.

A collective abandoned on the way (the ranks were found stuck in different
places: [Note: uneven inputs]) is different: gloo's abort does not end a
collective its worker is already running, which waits on its peer's socket
until the peer's process ends or the group's timeout passes. Its peer is
stuck the same way, so step 3 would wait out the timeout (half an hour by
default) on both sides after the error was printed. When such a process is
ending by an exception nobody caught (exit status 1), it flushes its output
and ends with `os._exit(1)`, skipping finalization and the exit handlers
registered before zerodp's: its closed sockets end the peer's wait, which
then ends the same way. It first waits (up to 30 s) until every peer has found
the uneven inputs too or has ended its script: the process group's store may
live in this process, and a peer whose wait failed on the closed connection
could no longer read why. A script that catches the error and exits
otherwise keeps the ordinary ending, and its exit status.

The shard, replica and hpZ groups (`zerodp.comm.subgroups`) are groups like
any other here: each has its `Comm`, aborted in step 1 when a collective of
its own is in flight, and `destroy_process_group()` with no argument destroys
them with the default group in step 3.

Nothing here runs when the user already destroyed the process group.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import weakref
from typing import Any

import torch.distributed as dist

from zerodp.comm.faults import failure_notices
from zerodp.comm.faults.comm_view import EndingComm
from zerodp.comm.faults.polled_waits import stop_waiting_thread
from zerodp.comm.faults.uneven_inputs import whereabouts

logger = logging.getLogger("zerodp")

_PEERS_SEE_S = 30.0  # how long an abandoning process waits for its peers to see why
_STOP_WAITING_S = 10.0  # the waiting thread's last wait returns once the group is aborted

_COMMS: weakref.WeakSet[EndingComm] = weakref.WeakSet()
_ABANDONED: list[str] = []  # collectives given up while still running (see the Note)
_registered = threading.Lock()
_REGISTERED: list[bool] = []


def register(comm: EndingComm | None = None) -> None:
    """Tear down at exit (registered once per process); `comm`'s collectives take part."""
    if comm is not None:
        _COMMS.add(comm)
    with _registered:
        if not _REGISTERED:
            atexit.register(end_collectives)
            failure_notices.install_excepthook()  # see [Note: failure notices]
            _REGISTERED.append(True)


def end_collectives() -> None:
    """Abort what cannot complete, stop the waiting thread, destroy the process groups.

    See [Note: ending the process]. Called at interpreter exit; safe to call twice.
    """
    if _ended_cleanly():  # ranks still waiting for this one learn that its script ended
        whereabouts().at_exit()
    if _ABANDONED and failure_notices.ended_by_uncaught_exception():
        whereabouts().wait_until_seen(_PEERS_SEE_S)
        _end_now(1)
    for group in _groups_to_abort():
        abort_group(group)
    if not stop_waiting_thread(_STOP_WAITING_S):
        logger.warning(
            "zerodp's collective-waiting thread did not stop within %.0f s at exit",
            _STOP_WAITING_S,
        )
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def abandon(group: Any, why: str) -> None:
    """Abort `group` while one of its collectives still runs, one that will never complete
    (`why`); see [Note: ending the process] for how the process then ends."""
    _ABANDONED.append(why)
    abort_group(group)


def _end_now(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing to write
            stream.flush()
    logging.shutdown()
    os._exit(status)


def abort_group(group: Any) -> None:
    """Abort `group` (None: the default group): its in-flight collectives fail at once."""
    target = group if group is not None else dist.group.WORLD
    abort = getattr(target, "abort", None)
    if abort is None:  # pragma: no cover - a backend without abort: nothing better to do
        return
    try:
        abort()
    except RuntimeError:  # pragma: no cover - the backend could not abort; it stays as is
        logger.warning("could not abort a process group")


def _ended_cleanly() -> bool:
    """No collective of this process failed and it posted no failure ([Note: failure
    notices]): the script ran to its end (or exited on purpose)."""
    if not (dist.is_available() and dist.is_initialized()) or failure_notices.posted_any():
        return False
    return all(comm.history.broken is None for comm in list(_COMMS))


def _groups_to_abort() -> list[Any]:
    groups: list[Any] = []
    if not (dist.is_available() and dist.is_initialized()):
        return groups
    for comm in list(_COMMS):
        # A failed collective aborted its group already (`Comm._abort_group`).
        pending = comm.world_size > 1 and comm.history.broken is None and comm.has_in_flight()
        if pending and all(comm.group is not seen for seen in groups):
            groups.append(comm.group)
    return groups
