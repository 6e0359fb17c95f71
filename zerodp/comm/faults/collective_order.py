"""Stage 3's collectives in the same order on every rank, or one error on every rank saying why.

[Note: collective order]
A stage 3 gather or reduction is a collective: a rank that runs a module the
others skip pairs its all-gather with whatever the others issue next. With
different sizes gloo aborts the process; with equal sizes (two experts of one
shape) training goes on with the wrong weights. So every collective issued
inside a forward or a backward is noted here first, as (operation, group),
before it is issued:

- A pass (a forward, a backward graph task) of a kind with no agreed order
  yet is checked: before each collective every rank posts what it is about to
  issue to the process group's store (out of band: nothing on the process
  group itself) and waits for every rank's post; the pass's end is posted too.
  All equal: go on. Any different: every rank has every post, and every rank
  raises the same `DivergenceError` naming what each one was doing. A pass
  checked to its end without difference becomes the agreed order of its kind.
- A later pass replays: each collective is compared with the agreed order,
  locally, at the cost of a list lookup. While every rank matches it, every
  rank issues the same collectives and nothing is exchanged.
- A rank whose next collective (or end) differs from the agreed order does
  not issue it: it raises an alarm in the store and goes on checked. Ranks that
  still replay are then, sooner or later, waiting in a collective the alarmed
  rank never joins; every wait zerodp makes looks at the store each
  `poll_s` seconds it lasts (`Comm.on_stall`, CPU tensors on gloo), answers
  the alarm with what it issued at that point, and the comparison fails
  there, on every rank. Ranks
  that took the same new path all raise alarms at the same point, agree, and
  go on checked; that pass becomes the new agreed order.

So a divergence costs about `poll_s` to report and never a hang (as long as
the ranks wait inside zerodp); steady training costs one comparison per
collective. Gathers and reductions outside a forward or backward
(`GatheredParameters`, the step) are the same on every rank by construction
and are not noted. After a `DivergenceError` the process group is unusable
(collectives are left waiting on it), and the engine raises it again.
"""

from __future__ import annotations

import datetime
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from zerodp.comm.faults import failure_notices
from zerodp.comm.faults.comm_view import WatchedComm
from zerodp.comm.faults.polled_waits import STALL_POLL_S
from zerodp.errors import DivergenceError, PeerFailedError

Entry = tuple[str, int]  # (operation, group order); END closes a pass
END: Entry = ("end", -1)
POLL_S = STALL_POLL_S  # how often a waiting rank looks at the store
DEFAULT_TIMEOUT_S = 1800.0  # without comms_timeout_s: torch's default for gloo

_INSTANCES = itertools.count()  # every rank builds its engines in the same order


@dataclass
class _Pass:
    kind: str
    number: int
    agreed: list[Entry] | None  # the order this pass replays; None: checked from the start
    checked_from: int | None = None  # where it left the agreed order (0: checked throughout)
    seq: int = 0
    issued: list[Entry] = field(default_factory=list)  # every entry, once checked
    finished: bool = False
    variant: str = ""  # passes of one kind whose orders differ by design keep one order each

    def __post_init__(self) -> None:
        if self.agreed is None:
            self.checked_from = 0

    @property
    def checked(self) -> bool:
        return self.checked_from is not None

    def replayed(self, seq: int) -> Entry | None:
        """What this rank issued at `seq` from the agreed order, unchecked (None: nothing)."""
        if self.agreed is None:
            return None
        upto = self.seq if self.checked_from is None else self.checked_from
        if seq < upto:
            return self.agreed[seq]
        if self.finished and self.checked_from is None and seq == len(self.agreed):
            return END
        return None

    @property
    def name(self) -> str:
        return f"{self.kind} pass {self.number + 1}"


class CollectiveOrder:
    """Checks that every rank issues the same stage 3 collectives (see [Note: collective order]).

    `describe(entry)` says what an entry does on this rank ("gathers `layers.3.attn`");
    `advise(entries)` what to do when ranks issued these different entries.
    """

    def __init__(
        self,
        comm: WatchedComm,
        *,
        describe: Callable[[Entry], str],
        advise: Callable[[list[Entry]], str],
        poll_s: float = POLL_S,
        timeout_s: float | None = None,
        watch_waits: bool = True,
    ) -> None:
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.poll_s = poll_s
        # A checked pass waits for every rank's post as long as a collective may wait.
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self._describe = describe
        self._advise = advise
        self._agree_first = comm.agree_first
        prefix = f"zerodp/order/{next(_INSTANCES)}/"
        self._store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        # This check's pass notices; exit notices are the process's ([Note: failure notices]).
        self._failures = failure_notices.FailureBoard(self._store, self.rank, self.world_size)
        comm.failure_boards.append(self._failures)
        self._logs: dict[tuple[str, str], list[Entry]] = {}
        self._numbers: Counter[str] = Counter()
        self._passes: list[_Pass] = []
        self._last: dict[str, _Pass] = {}  # the last finished pass of each kind
        self._error: DivergenceError | PeerFailedError | None = None
        self.num_checked = 0  # collectives agreed through the store
        self.num_replayed = 0  # collectives compared with the agreed order only
        if watch_waits:  # gloo; an NCCL wait returns at once, the GPU waits (not watched)
            before = comm.on_stall

            def on_stall() -> None:
                self.on_stall()
                if before is not None:
                    before()

            comm.on_stall = on_stall

    # -- passes ----------------------------------------------------------------------

    def begin(self, kind: str, variant: str = "") -> None:
        """A pass of `kind` starts; it replays the agreed order of the last checked pass of
        its kind and `variant` (a backward that reduces across shard groups issues more
        than one that does not: each keeps its own, so neither sends the other back to
        the store's check)."""
        self.raise_if_failed()
        if kind == "backward":  # one left by a task whose end never came (it raised)
            self._passes = [p for p in self._passes if p.kind != kind]
        number = self._numbers[kind]
        self._numbers[kind] += 1
        self._passes.append(_Pass(kind, number, self._logs.get((kind, variant)), variant=variant))

    def note(self, operation: str, tag: int, label: str = "world") -> None:
        """A collective on group `tag` is about to be issued in the group labelled `label`:
        check it first."""
        if not self._passes:
            return
        self.raise_if_failed()
        current = self._passes[-1]
        entry = (operation, tag)
        agreed = current.agreed or []
        replayed = (
            not current.checked and current.seq < len(agreed) and agreed[current.seq] == entry
        )
        # The ranks agree on what they do before this pass's store posts, as before its
        # collectives ([Note: agreeing before a collective]): a replayed collective posts
        # nothing, so it agrees as its own group's collective would.
        self._agree_first(operation, label if replayed else "world")
        if replayed:
            current.seq += 1
            self.num_replayed += 1
            return
        if not current.checked:
            self._leave_agreed_order(current)
        self._agree(current, current.seq, entry)
        current.issued.append(entry)
        current.seq += 1

    def end(self) -> None:
        """The innermost pass is over; a checked one becomes its kind's agreed order."""
        if not self._passes or self._error is not None:
            self._passes.clear()
            return
        current = self._passes[-1]
        agreed = current.agreed or []
        if not current.checked and current.seq != len(agreed):
            self._leave_agreed_order(current)
        if current.checked:
            self._agree(current, current.seq, END)
            self._logs[(current.kind, current.variant)] = current.issued
        self._passes.pop()
        current.finished = True
        self._last[current.kind] = current

    def abandon(self) -> None:
        """A forward or backward died part-way on this rank: nothing of it is compared."""
        self._passes.clear()

    def fail(self, error: BaseException) -> None:
        """The innermost pass dies of `error` on this rank: tell the others, then abandon it.

        The ranks waiting for this one's part of the pass name it and its error instead of
        reporting a divergence or waiting out the timeout ([Note: failure notices]).
        """
        if self._passes and self._error is None:
            current = self._passes[-1]
            self._failures.post(error, current.kind, current.number)
        self.abandon()

    # -- waiting -----------------------------------------------------------------------

    def on_stall(self) -> None:
        """Called every `poll_s` seconds a collective is waited on: answer other ranks' alarms,
        and stop if a peer failed."""
        self.raise_if_failed()
        self._raise_if_peer_failed("the collective this rank is waiting in")
        if int(self._store.add("alarms", 0)) > 0:
            self._answer_alarms()

    def _raise_if_peer_failed(self, doing: str) -> None:
        """Raise `PeerFailedError` for a notice that is not stale (see [Note: failure notices])."""
        current = [
            notice
            for notice in self._failures.read()
            if notice.number >= self._numbers[notice.kind] - 1
        ]
        notices = failure_notices.one_per_rank(current + failure_notices.read_exits())
        if notices:
            self._error = failure_notices.peer_failed_error(notices, doing)
            raise self._error

    def _answer_alarms(self) -> None:
        for rank in range(self.world_size):
            key = f"alarm/{rank}"
            if rank == self.rank or not self._store.check([key]):
                continue
            kind, number, seq = self._store.get(key).decode().split()
            mine = self._pass_of(kind, int(number))
            entry = mine.replayed(int(seq)) if mine is not None else None
            if mine is not None and entry is not None:
                self._agree(mine, int(seq), entry)
                raise RuntimeError(  # pragma: no cover - the alarmed rank left this order
                    f"internal error: rank {rank} left the agreed order at {entry}, but agrees"
                )

    def _pass_of(self, kind: str, number: int) -> _Pass | None:
        for candidate in [*self._passes, self._last.get(kind)]:
            if candidate is not None and candidate.kind == kind and candidate.number == number:
                return candidate
        return None

    # -- agreement -----------------------------------------------------------------------

    def _leave_agreed_order(self, current: _Pass) -> None:
        current.checked_from = current.seq
        current.issued = list((current.agreed or [])[: current.seq])
        self._store.set(f"alarm/{self.rank}", f"{current.kind} {current.number} {current.seq}")
        self._store.add("alarms", 1)

    def _agree(self, current: _Pass, seq: int, entry: Entry) -> None:
        """Post `entry` as this rank's collective `seq` of `current`; wait for every rank's."""
        base = f"{current.kind}{current.number}/{seq}/"
        text = self._describe(entry) if entry != END else f"ends its {current.kind} pass"
        self._store.set(base + str(self.rank), f"{entry[0]} {entry[1]}\n{text}")
        keys = [base + str(rank) for rank in range(self.world_size)]
        waited = 0.0
        while not self._waited_for(keys):
            waited += self.poll_s
            if waited >= self.timeout_s:
                self._fail_absent(current, seq, keys)
            self._raise_if_peer_failed(f"collective {seq + 1} of the {current.name}")
            self._answer_alarms()  # a rank checked from further on may wait for this one
        posts = [value.decode().split("\n", 1) for value in self._store.multi_get(keys)]
        self.num_checked += 1
        if seq > 0 and current.checked_from is not None and seq > current.checked_from:
            self._store.delete_key(f"{current.kind}{current.number}/{seq - 1}/{self.rank}")
        if len({head for head, _ in posts}) > 1:
            self._fail(current, seq, posts)

    def _waited_for(self, keys: list[str]) -> bool:
        """Whether every key is posted, waiting up to `poll_s` for them."""
        try:
            self._store.wait(keys, datetime.timedelta(seconds=self.poll_s))
        except dist.DistStoreError as error:
            if "timeout" not in str(error).lower():
                raise
            return False
        return True

    # -- errors ----------------------------------------------------------------------

    def _fail(self, current: _Pass, seq: int, posts: list[list[str]]) -> None:
        self._raise_if_peer_failed(f"collective {seq + 1} of the {current.name}")
        entries = []
        for head, _ in posts:
            operation, tag = head.split()
            entries.append((operation, int(tag)))
        doing = "; ".join(f"rank {rank} {text}" for rank, (_, text) in enumerate(posts))
        self._error = DivergenceError(
            f"ranks took different paths through the model at ZeRO stage 3 "
            f"({current.name}, collective {seq + 1}): {doing}. Every rank must gather and "
            f"reduce the same parameters in the same order. {self._advise(entries)}"
        )
        raise self._error

    def _fail_absent(self, current: _Pass, seq: int, keys: list[str]) -> None:
        self._raise_if_peer_failed(f"collective {seq + 1} of the {current.name}")
        absent = [rank for rank, key in enumerate(keys) if not self._store.check([key])]
        self._error = DivergenceError(
            f"ranks {absent} did not reach collective {seq + 1} of the {current.name} at ZeRO "
            f"stage 3 within {self.timeout_s:.0f}s (blocked outside zerodp, or dead)"
        )
        raise self._error

    @property
    def failed(self) -> bool:
        return self._error is not None

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
