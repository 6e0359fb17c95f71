"""Before the first collective of what a rank does next, every rank agrees that it does the same.

[Note: agreeing before a collective]
gloo pairs the n-th collective of each rank with the n-th of every other,
whatever each one is. Ranks that went different ways (one ran out of batches
and saves a checkpoint while another gathers the parameters of its next
forward) post collectives of different sizes, and gloo aborts the process
from its own thread ("Received data size doesn't match expected size",
SIGABRT). Nothing that runs once the collective is posted (a timeout, a stall
check) can turn that into an error: the disagreement must be found before.

So the things a rank does whose collectives can only pair with the same thing
on every other rank are named (`Activity`: a forward pass, a backward graph
task, an optimizer step, a checkpoint save or load), and each one starts with
`begin(activity)`. Before the first collective zerodp issues after that (any
`Comm`, any group: `Comm.agree_first`), every rank agrees on where it is: one
all-reduce (MAX) of six integers (the activity, the optimizer steps and
micro-steps taken, and their negatives) on a gloo group of its own, so that it
can only ever pair with another rank's agreement, never with a collective of
the work itself. All equal: the activity goes on, and its other collectives
pass with a flag read each. Different: every rank learns it from the same
result, the ranks exchange their places (on the same group), and every rank
raises the same `UnevenInputsError` naming each rank's place. Nothing
mismatched reached the backend and nothing is left running, so a script that
catches the error ends at once, and one that does not exits with status 1.
After it, every collective of an engine that agrees is refused with the same
error, so that no rank starts another agreement the others never join.

A rank whose script ended posts that in the store ([Note: uneven inputs] in
`zerodp.comm.faults.uneven_inputs`); an agreement is waited for like any collective
(polled each second), so a rank waiting in one for a rank that ended, or for a
rank stuck somewhere zerodp did not agree (a collective outside these
activities), hears where that rank is and raises the same error.

What it costs: an activity that issues no collective agrees on nothing (a
forward at stages 0-2); an optimizer step agrees when it starts
(`agree_now`), before it changes anything, so that the error leaves the step
untaken; the others agree at their first collective. One small collective per
forward at stage 3, per backward, per optimizer step, per save and per load
(`bench/uneven_agreement.py` measures it). Only where stalls are watched
(gloo, `comms_stall_checks`); with NCCL a mismatched collective does not
abort the process, and NCCL's watchdog reports a stuck one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from zerodp.comm import object_collectives
from zerodp.comm.faults.collective_history import passes_through
from zerodp.comm.faults.comm_view import AgreeingComm
from zerodp.comm.faults.polled_waits import wait_timed
from zerodp.comm.faults.teardown import abort_group
from zerodp.comm.faults.uneven_inputs import Activity, Place, uneven_inputs_error, whereabouts
from zerodp.errors import UnevenInputsError

_CODES = {activity: code for code, activity in enumerate(Activity)}


class Agreement:
    """The process's agreement: its group, whether the current activity is agreed yet, and
    the error once ranks disagreed (see [Note: agreeing before a collective])."""

    def __init__(self) -> None:
        # Weak references: the process groups must die when the teardown destroys them, so
        # that their destructors join gloo's threads before the interpreter finalizes
        # ([Note: ending the process] in zerodp.comm.faults.teardown).
        self._group: weakref.ref[Any] | None = None
        self._for_world: weakref.ref[Any] | None = None  # the default group beside it
        self.pending = False  # an activity began and has not been agreed on yet
        self.failed: UnevenInputsError | None = None
        self.num_agreed = 0  # agreements made (for benchmarks and tests)
        self.seconds = 0.0  # time spent in them

    # -- set-up ----------------------------------------------------------------------

    def install(self, comm: AgreeingComm, timeout: datetime.timedelta | None) -> None:
        """Make the agreement group beside the default group, once (a collective: every rank
        calls it, after the start-up check). Nothing where `comm` does not watch stalls."""
        if not comm.watches_stalls or comm.group is not None:
            return
        if self._live_group() is not None:
            return
        group = dist.new_group(backend="gloo", timeout=timeout, group_desc="zerodp agree")
        self._group = weakref.ref(group)
        self._for_world = weakref.ref(dist.group.WORLD)
        self.pending = False
        self.failed = None

    def _live_group(self) -> Any:
        """The agreement group, while the default group it was made beside is the current one
        (None before `install`, and once the process groups were destroyed)."""
        if self._group is None or self._for_world is None:
            return None
        world = self._for_world()
        if world is None or world is not dist.group.WORLD:
            return None
        return self._group()

    # -- activities ------------------------------------------------------------------

    def begin(self, activity: Activity) -> None:
        """This rank starts `activity`: its first collective agrees on it first."""
        whereabouts().activity = activity
        self.pending = True

    @contextlib.contextmanager
    def doing(self, activity: Activity) -> Iterator[None]:
        """`activity` for the duration of the block (a save, a load); the activity before it
        comes back afterwards, agreed (the block's own agreement covered the ranks' order)."""
        before = whereabouts().activity
        self.begin(activity)
        try:
            yield
        finally:
            whereabouts().activity = before
            self.pending = False

    def agree_now(self, comm: AgreeingComm, activity: Activity, what: str) -> None:
        """Begin `activity` and agree on it at once, before `what` (an optimizer step, which
        changes nothing until the ranks agreed)."""
        self.begin(activity)
        comm.agree_first(what)

    # -- before a collective ---------------------------------------------------------

    def before(self, comm: AgreeingComm, kind: str) -> None:
        """Called before every collective of `comm` (the default group's `Comm`)."""
        if self.failed is not None:
            raise UnevenInputsError(str(self.failed))
        if not self.pending:
            return
        group = self._live_group()
        if group is None:
            return
        self.pending = False
        start = time.perf_counter()
        try:
            self._agree(comm, kind, group)
        finally:
            self.num_agreed += 1
            self.seconds += time.perf_counter() - start

    def reset(self) -> None:
        """Forget a disagreement (a test that runs many scenarios in one process: after an
        agreement failed, nothing is left running, so the ranks may start over together)."""
        self.pending = False
        self.failed = None
        whereabouts().activity = Activity.TRAINING

    def _agree(self, comm: AgreeingComm, kind: str, group: Any) -> None:
        place = whereabouts().here(comm.rank, "")
        record = comm.history.issue(f"agreement before {kind}", 6 * 8)
        values = [_CODES[place.activity], place.steps, place.micro_steps]
        both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64)
        self._wait(comm, record, group, dist.all_reduce(both, dist.ReduceOp.MAX, group, True))
        if both[:3].tolist() == (-both[3:]).tolist():
            comm.history.finish(record)
            return
        waiting_in = f"the agreement before {kind} (from {record.site})"
        mine = dataclasses.replace(place, waiting_in=waiting_in)

        def finish(work: Any, async_op: bool) -> None:
            self._wait(comm, record, group, work)

        texts = object_collectives.gather_objects(mine.encode(), group, comm.world_size, finish)
        comm.history.finish(record)
        places = [Place.decode(rank, text) for rank, text in enumerate(texts)]
        self.failed = uneven_inputs_error(places, found="at different places")
        raise UnevenInputsError(str(self.failed))

    @staticmethod
    def _wait(comm: AgreeingComm, record: Any, group: Any, work: Any) -> None:
        """Wait for one of the agreement's collectives as for any: polled, so that a rank
        that ended or is stuck elsewhere is heard; a failure names the agreement."""
        on_stall = comm.on_stall
        try:
            stalled = wait_timed(work, on_stall) if on_stall is not None else work.wait()
        except RuntimeError as error:
            abort_group(group)  # its collective will never complete
            if passes_through(error):
                raise
            raise comm.history.failed(record, error) from error
        if stalled:
            whereabouts().recovered()


_AGREEMENT = Agreement()


def agreement() -> Agreement:
    """The process's one `Agreement` (activities are per process, as the store keys are)."""
    return _AGREEMENT
