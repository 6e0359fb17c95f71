"""Uneven inputs found in seconds: ranks that are stuck say where they are.

[Note: uneven inputs]
Ranks often have different numbers of batches (a data set that does not
divide evenly, an iterable data set that ends early). The rank that runs out
first goes on to whatever follows its loop: a checkpoint save, the end of the
script. Its collectives then pair with the training collectives of the ranks
still in their loop; on gloo they wait until the timeout, each naming another
collective, and nothing says "uneven inputs".

So a rank whose wait lasts (`Comm.on_stall`, each `STALL_POLL_S` seconds, gloo
only: an NCCL wait returns at once and the GPU waits) posts where it is in the
process group's store: what it is doing (a forward, a backward, an optimizer
step, saving or loading a checkpoint, waiting for a save: `Activity`) and its
step counts; a rank whose script ends posts that too. It then reads the other
ranks' posts. Two ranks stuck at different places (a save against a step, step
4 against step 3, a step against the end of a script) cannot both go on: every
rank that sees that raises the same `UnevenInputsError`, naming each rank's
place, and aborts the process group so that a peer blocked elsewhere fails at
once. A post is removed when its wait completes, so a rank that was merely slow
leaves nothing behind.

The cost is nothing while collectives complete: the activity is a field set
when each activity begins, the step counts are read only once a wait has lasted
a second. Most disagreements are found before this, without a wait: the ranks
agree on each activity before its first collective ([Note: agreeing before a
collective] in `zerodp.comm.agreement`); these posts find a rank whose script
ended and one stuck where nothing was agreed. `engine.join()` (DDP's `Join`) is
the way to train on uneven inputs.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from zerodp.errors import UnevenInputsError

logger = logging.getLogger("zerodp")

_PREFIX = "zerodp/whereabouts/"
_COUNT = _PREFIX + "count"
_SEEN = _PREFIX + "seen"  # how many ranks raised UnevenInputsError
_SEEN_POLL_S = 0.05


class Activity(enum.Enum):
    """What a rank is doing, as far as its collectives go (the ones after TRAINING are
    agreed on before their first collective: [Note: agreeing before a collective])."""

    TRAINING = "training"
    SAVING = "saving a checkpoint"
    LOADING = "loading a checkpoint"
    # wait_for_checkpoint: its own, so that a rank waiting beside one saving disagrees (both
    # start with the same agreement on the previous save's verdict; only the save goes on).
    WAITING_FOR_SAVE = "waiting for a checkpoint save"
    FINISHED = "ended its script"
    FORWARD = "in a forward pass"
    BACKWARD = "in a backward pass"
    STEP = "in an optimizer step"
    GATHERING = "gathering parameters (GatheredParameters)"
    JOINING = "entering engine.join()"


Position = Callable[[], tuple[int, int]]  # (optimizer steps taken, micro-steps taken)


@dataclass(frozen=True)
class Place:
    """Where one rank is: its activity and step counts, and what it waits in."""

    rank: int
    activity: Activity
    steps: int
    micro_steps: int
    waiting_in: str

    def describe(self) -> str:
        counts = f"{self.steps} optimizer steps ({self.micro_steps} micro-batches)"
        if self.activity is Activity.FINISHED:
            return f"rank {self.rank} ended its script after {counts}"
        if self.activity is Activity.TRAINING:
            where = f"rank {self.rank} is training after {counts}"
        else:
            where = f"rank {self.rank} is {self.activity.value} after {counts}"
        return f"{where}, waiting in {self.waiting_in}" if self.waiting_in else where

    def encode(self) -> str:
        return f"{self.activity.name} {self.steps} {self.micro_steps}\n{self.waiting_in}"

    @classmethod
    def decode(cls, rank: int, text: str) -> Place:
        head, _, waiting_in = text.partition("\n")
        activity, steps, micro_steps = head.split()
        return cls(rank, Activity[activity], int(steps), int(micro_steps), waiting_in)

    def same_place(self, other: Place) -> bool:
        return (self.activity, self.steps, self.micro_steps) == (
            other.activity,
            other.steps,
            other.micro_steps,
        )


class Whereabouts:
    """This process's activity and step counts, and the stall posts of the other ranks."""

    def __init__(self) -> None:
        self.activity = Activity.TRAINING
        self._position: Position | None = None
        self._posted = False

    def track(self, position: Position) -> None:
        """Read step counts from `position` (the engine that trains; the last one wins)."""
        self._position = position

    def here(self, rank: int, waiting_in: str) -> Place:
        steps, micro_steps = self._position() if self._position is not None else (0, 0)
        return Place(rank, self.activity, steps, micro_steps, waiting_in)

    # -- while a wait lasts ---------------------------------------------------------

    def on_stall(self, waiting_in: str, abort: Callable[[], None]) -> None:
        """Post this rank's place (once per stuck wait); raise if another rank is stuck
        elsewhere. `abort` ends the process group first (see [Note: uneven inputs])."""
        store = _store()
        if store is None:
            return
        mine = self.here(dist.get_rank(), waiting_in)
        try:
            if not self._posted:
                store.set(_PREFIX + str(mine.rank), mine.encode())
                store.add(_COUNT, 1)
                self._posted = True
            others = _read(store, mine.rank)
        except Exception:  # the store's host is gone: the collective's own error will say
            logger.debug("could not exchange whereabouts", exc_info=True)
            return
        elsewhere = [place for place in others if not place.same_place(mine)]
        if not elsewhere:
            return
        abort()
        _count_seen(store)
        raise uneven_inputs_error(sorted([mine, *others], key=lambda place: place.rank))

    def recovered(self) -> None:
        """A wait that stalled completed: withdraw this rank's post."""
        if not self._posted:
            return
        self._posted = False
        store = _store()
        if store is None:
            return
        try:
            store.delete_key(_PREFIX + str(dist.get_rank()))
        except Exception:
            logger.debug("could not withdraw a whereabouts post", exc_info=True)

    def at_exit(self) -> None:
        """The script ends: tell ranks still waiting for this one (never raises)."""
        store = _store()
        if store is None:
            return
        mine = self.here(dist.get_rank(), "")
        finished = Place(mine.rank, Activity.FINISHED, mine.steps, mine.micro_steps, "")
        try:
            store.set(_PREFIX + str(mine.rank), finished.encode())
            store.add(_COUNT, 1)
        except Exception:
            logger.debug("could not post the end of the script", exc_info=True)

    def peers_elsewhere(self, waiting_in: str) -> list[Place]:
        """The places of every rank when another rank posted a different one (else [])."""
        store = _store()
        if store is None:
            return []
        mine = self.here(dist.get_rank(), waiting_in)
        try:
            others = _read(store, mine.rank)
        except Exception:
            return []
        if all(place.same_place(mine) for place in others):
            return []
        _count_seen(store)
        return sorted([mine, *others], key=lambda place: place.rank)

    def wait_until_seen(self, timeout_s: float) -> None:
        """Before a process that found uneven inputs ends at once: wait (at most
        `timeout_s`) until every other rank has found them too or has ended its script.

        The process group's store may live in this process (rank 0 outside torchrun);
        a peer whose wait then fails on the closed connection could no longer read the
        posts that say why. Never raises.
        """
        store = _store()
        if store is None:
            return
        deadline = time.monotonic() + timeout_s
        rank = dist.get_rank()
        while time.monotonic() < deadline:
            try:
                seen = int(store.add(_SEEN, 0))
                ended = sum(p.activity is Activity.FINISHED for p in _read(store, rank))
            except Exception:
                return
            if seen + ended >= dist.get_world_size():
                return
            time.sleep(_SEEN_POLL_S)


def uneven_inputs_error(
    places: list[Place], found: str = "stuck in different places"
) -> UnevenInputsError:
    """The error every rank raises when the ranks are at `places` (the same on each)."""
    return UnevenInputsError(
        f"uneven inputs: the ranks are {found}: "
        + "; ".join(place.describe() for place in places)
        + ". Every rank must make the same zerodp calls in the same order, so each needs "
        "the same number of batches: drop the remainder (drop_last=True, "
        "DistributedSampler(drop_last=True)), or train inside `with engine.join():`, where "
        "ranks that run out shadow the others"
    )


def _read(store: Any, skip_rank: int) -> list[Place]:
    if int(store.add(_COUNT, 0)) == 0:
        return []
    places = []
    for rank in range(dist.get_world_size()):
        key = _PREFIX + str(rank)
        if rank != skip_rank and store.check([key]):
            places.append(Place.decode(rank, store.get(key).decode()))
    return places


def _count_seen(store: Any) -> None:
    try:
        store.add(_SEEN, 1)
    except Exception:  # the store's host is gone: nobody is left to wait for this
        logger.debug("could not count a rank that found uneven inputs", exc_info=True)


def _store() -> Any:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


_lock = threading.Lock()
_PROCESS: list[Whereabouts] = []


def whereabouts() -> Whereabouts:
    """The process's one `Whereabouts` (its store keys are per process, not per engine)."""
    with _lock:
        if not _PROCESS:
            _PROCESS.append(Whereabouts())
        return _PROCESS[0]
