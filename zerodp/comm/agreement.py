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

In shard groups that replicate each other (`mics_shard_size`), an agreement
over every rank would cross nodes twice per micro-batch where nothing else
does. So an activity the engine begins as local (the forward and backward of
a micro-batch that is not the accumulation boundary: `begin(local=True)`)
agrees over its shard group only (a gloo group of its own per shard group,
`install_local`), before its first collective inside the shard group; should
it issue a collective outside it (over the world, the replicas, a tensor
group), the ranks agree over the world first. Every other activity (the
boundary's forward and backward, which end in the all-reduce across shard
groups, the optimizer step, a save, a load) agrees over the world, as before.
The shard groups' agreements only ever pair among themselves and the world's
among themselves, so uneven inputs inside a shard group are found at once, on
its ranks, and shard groups that went different ways are found at the next
boundary, before anything crosses between them: once per optimizer step.
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
from zerodp.comm.faults.comm_view import AgreeingComm, AgreeingGroups
from zerodp.comm.faults.polled_waits import wait_timed
from zerodp.comm.faults.teardown import abort_group
from zerodp.comm.faults.uneven_inputs import Activity, Place, uneven_inputs_error, whereabouts
from zerodp.comm.stats import WORLD
from zerodp.errors import UnevenInputsError
from zerodp.parallel import SHARD

_CODES = {activity: code for code, activity in enumerate(Activity)}
_AGREEMENT_BYTES = 6 * 8  # six int64


class Agreement:
    """The process's agreement: its group, whether the current activity is agreed yet, and
    the error once ranks disagreed (see [Note: agreeing before a collective])."""

    def __init__(self) -> None:
        # Weak references: the process groups must die when the teardown destroys them, so
        # that their destructors join gloo's threads before the interpreter finalizes
        # ([Note: ending the process] in zerodp.comm.faults.teardown).
        self._group: weakref.ref[Any] | None = None
        self._for_world: weakref.ref[Any] | None = None  # the default group beside it
        self.pending = False  # an activity began and has not been agreed on over the world
        self._local: _LocalScope | None = None  # the shard group's agreement (install_local)
        self.local_scope = False  # the current activity agrees inside its shard group first
        self.pending_local = False  # ... and has not yet
        self.failed: UnevenInputsError | None = None
        self.num_agreed = 0  # agreements made (for benchmarks and tests)
        self.seconds = 0.0  # time spent in them
        self.num_local = 0  # of them, over a shard group only

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

    def install_local(self, comms: AgreeingGroups, timeout: datetime.timedelta | None) -> None:
        """With shard groups that replicate each other: a gloo group per shard group (a
        collective: every rank calls it after `install`, with the same groups), and the
        labels of the groups inside a shard group (whose collectives a local activity's
        agreement covers). Nothing without replicas, or where the world does not agree."""
        self._local = None
        dims = comms.dims
        if self._live_group() is None or dims.num_replicas < 2:
            return
        key = tuple(tuple(group) for group in dims.groups_of(SHARD))
        made = _LOCAL_GROUPS.get(key)
        if made is None or made[0]() is not dist.group.WORLD:
            group = dist.new_subgroups_by_enumeration(
                [list(g) for g in key], timeout=timeout, backend="gloo", group_desc="zerodp agree"
            )[0]
            made = (weakref.ref(dist.group.WORLD), weakref.ref(group))
            _LOCAL_GROUPS.clear()
            _LOCAL_GROUPS[key] = made
        self._local = _LocalScope(made[1], comms.inside_shard_group())

    def _live_local(self) -> Any:
        """The shard group's agreement group, while the world's is live."""
        if self._local is None or self._live_group() is None:
            return None
        return self._local.group()

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

    def begin(self, activity: Activity, *, local: bool = False) -> None:
        """This rank starts `activity`: its first collective agrees on it first. With shard
        groups, inside the shard group first; `local`: only there, unless it issues a
        collective outside that group."""
        whereabouts().activity = activity
        self.pending = True
        self.pending_local = self._live_local() is not None
        self.local_scope = local and self.pending_local

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
            self.pending = self.pending_local = False

    def agree_now(self, comm: AgreeingComm, activity: Activity, what: str) -> None:
        """Begin `activity` and agree on it at once, before `what` (an optimizer step, which
        changes nothing until the ranks agreed)."""
        self.begin(activity)
        comm.agree_first(what)

    # -- before a collective ---------------------------------------------------------

    def before(self, comm: AgreeingComm, kind: str, label: str = WORLD) -> None:
        """Called before every collective of `comm` (the default group's `Comm`) or of one
        of its subgroups (`label`)."""
        if self.failed is not None:
            raise UnevenInputsError(str(self.failed))
        if not self.pending:
            return
        inside = self.local_scope and self._local is not None and label in self._local.inside
        if self.pending_local:
            self.pending_local = False
            agreed = self._timed(comm, kind, SHARD)
            if agreed and inside:
                return  # the world's agreement waits for a collective outside the shard group
            # Agreed and about to leave the shard group, or disagreed inside it: the world's
            # agreement (every other shard group's ranks join it) says so on every rank.
        elif inside:
            return
        self.pending = False
        if not self._timed(comm, kind, WORLD):
            self._raise_uneven(comm, kind)

    def _timed(self, comm: AgreeingComm, kind: str, scope: str) -> bool:
        """One agreement round over the world or this rank's shard group (`scope`), counted
        and timed; whether every rank there is at the same place."""
        group = self._live_group() if scope == WORLD else self._live_local()
        if group is None:
            return True
        start = time.perf_counter()
        try:
            return self._round(comm, kind, group, scope)
        finally:
            comm.stats.record_agreement(scope, _AGREEMENT_BYTES)
            self.num_agreed += 1
            self.num_local += scope == SHARD
            self.seconds += time.perf_counter() - start

    def reset(self) -> None:
        """Forget a disagreement (a test that runs many scenarios in one process: after an
        agreement failed, nothing is left running, so the ranks may start over together)."""
        self.pending = self.pending_local = False
        self.failed = None
        whereabouts().activity = Activity.TRAINING

    def _round(self, comm: AgreeingComm, kind: str, group: Any, scope: str) -> bool:
        """All-reduce (MAX) this rank's place and its negation over `group`: whether every
        rank there is at the same place."""
        place = whereabouts().here(comm.rank, "")
        over = "" if scope == WORLD else " in the shard group"
        record = comm.history.issue(f"agreement{over} before {kind}", _AGREEMENT_BYTES)
        values = [_CODES[place.activity], place.steps, place.micro_steps]
        both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64)
        self._wait(comm, record, group, dist.all_reduce(both, dist.ReduceOp.MAX, group, True))
        comm.history.finish(record)
        return bool(both[:3].tolist() == (-both[3:]).tolist())

    def _raise_uneven(self, comm: AgreeingComm, kind: str) -> None:
        """The world's ranks disagreed: exchange their places (on the agreement's group) and
        raise the same `UnevenInputsError` on every rank."""
        group = self._live_group()
        record = comm.history.issue(f"agreement before {kind}", _AGREEMENT_BYTES)
        mine = dataclasses.replace(
            whereabouts().here(comm.rank, ""),
            waiting_in=f"the agreement before {kind} (from {record.site})",
        )

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


@dataclasses.dataclass(frozen=True)
class _LocalScope:
    """This rank's shard group: its agreement group and the labels of the groups that lie
    inside it."""

    group: weakref.ref[Any]
    inside: frozenset[str]


# The shard groups' agreement groups, made once per default group (new_group is a collective).
_LOCAL_GROUPS: dict[tuple[tuple[int, ...], ...], tuple[weakref.ref[Any], weakref.ref[Any]]] = {}

_AGREEMENT = Agreement()


def agreement() -> Agreement:
    """The process's one `Agreement` (activities are per process, as the store keys are)."""
    return _AGREEMENT
