"""Typed collectives over one process group, counting bytes and calls per kind.

Every collective zerodp issues goes through `Comm`, so the benchmarks and the
tests that check ZeRO's communication volume read one set of counters.
Bytes are those of the full (unsharded) tensor a collective operates on: an
all-reduce of n elements, a reduce-scatter whose input has n elements and an
all-gather whose output has n elements each count n * element size; an
all-to-all counts the bytes this rank sends to the others (its own split,
which never leaves the rank, is not counted), so that the sum over ranks is
the traffic.
"""

from __future__ import annotations

import enum
import pickle
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerodp.comm import failures
from zerodp.comm.history import (
    CollectiveHistory,
    CollectiveRecord,
    passes_through,
    recorded,
    tensor_nbytes,
)
from zerodp.comm.teardown import abort_group, register
from zerodp.comm.waiting import OnStall, WatchedWork, wait_timed, watch
from zerodp.errors import AGREED_TYPES, AgreedError

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveKind(enum.Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"


@dataclass
class CommStats:
    """Bytes and calls per collective kind since the last `reset()`."""

    bytes: Counter[CollectiveKind] = field(default_factory=Counter)
    calls: Counter[CollectiveKind] = field(default_factory=Counter)

    def record(self, kind: CollectiveKind, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {
            kind.value: {"bytes": self.bytes[kind], "calls": self.calls[kind]}
            for kind in CollectiveKind
        }


class Handle:
    """An in-flight collective; `wait()` blocks until its result may be read.

    With `on_stall`, a wait that lasts calls it every second (it may raise; see
    `zerodp.comm.waiting`). `timed`: the work honours a timed wait (gloo's reduce-scatter
    does not).
    """

    __slots__ = ("__weakref__", "_history", "_on_stall", "_record", "_watched", "_work")

    def __init__(
        self, work: Any = None, on_stall: OnStall | None = None, timed: bool = True
    ) -> None:
        self._work = work
        self._on_stall = on_stall
        # An untimed work that is watched is waited for by the helper thread from now on.
        self._watched: WatchedWork | None = (
            watch(work) if work is not None and on_stall is not None and not timed else None
        )
        self._record: CollectiveRecord | None = None
        self._history: CollectiveHistory | None = None

    def track(self, record: CollectiveRecord, history: CollectiveHistory) -> None:
        """Name the collective in a failure of `wait()` (see `zerodp.comm.history`)."""
        self._record, self._history = record, history

    def wait(self) -> None:
        if self._work is not None:
            try:
                if self._on_stall is None:
                    self._work.wait()
                elif self._watched is not None:
                    self._watched.wait(self._on_stall)
                else:
                    wait_timed(self._work, self._on_stall)
            except RuntimeError as error:
                if self._history is None or self._record is None or passes_through(error):
                    raise  # zerodp's own (a divergence found while waiting), out of memory
                raise self._history.failed(self._record, error) from error
            self._work = None
            if self._history is not None and self._record is not None:
                self._history.finish(self._record)

    @property
    def done(self) -> bool:
        return self._work is None


_DONE = Handle()


class Comm:
    """The collectives of one process group (the default group unless given)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stats = CommStats()
        # Called while a collective waits long (set by zerodp.comm.order; CPU/gloo only).
        self.on_stall: OnStall | None = None
        # Pass notices of the order check beside the process's exit notices.
        self.failure_boards: list[failures.FailureBoard] = []
        # For errors that name the collective; the first one aborts the group.
        self.history = CollectiveHistory(
            self.rank, on_failure=self._abort_group, notices=self.failure_notices
        )
        # Collectives issued with async_op and not yet waited for (prefetched gathers,
        # the reducer's reductions): what the teardown at exit must not leave pending.
        self._in_flight: weakref.WeakSet[Handle] = weakref.WeakSet()
        register(self)  # see [Note: ending the process] in zerodp.comm.teardown

    def _abort_group(self) -> None:
        """A collective failed (a peer died or froze): abort the process group.

        Its other in-flight collectives then fail at once instead of waiting out their
        timeouts, and none is left pending when the process exits (see [Note: ending the
        process] in zerodp.comm.teardown).
        """
        abort_group(self.group)

    def failure_notices(self) -> list[failures.FailureNotice]:
        """What ranks that failed posted ([Note: failure notices]); read only on a failure."""
        notices = [notice for board in self.failure_boards for notice in board.read()]
        return failures.one_per_rank(notices + failures.read_exits())

    def has_in_flight(self) -> bool:
        """Whether a collective this `Comm` issued asynchronously has not been waited for."""
        return any(not handle.done for handle in list(self._in_flight))

    def _in_flight_handle(self, work: Any, timed: bool = True) -> Handle:
        handle = Handle(work, self.on_stall, timed=timed)
        self._in_flight.add(handle)
        return handle

    # -- tensors -----------------------------------------------------------------

    @recorded("all_reduce")
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle:
        if self.world_size == 1:
            return _DONE
        self.stats.record(CollectiveKind.ALL_REDUCE, tensor_nbytes(tensor))
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        work = dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=async_op)
        return self._in_flight_handle(work) if async_op else _DONE

    @recorded("reduce_scatter")
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Handle:
        """Sum `input` over ranks; this rank receives chunk `rank` of the sum in `output`.

        `output` may alias chunk `rank` of `input` (an in-place reduce-scatter).
        """
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter: input has {input.numel()} elements, expected "
                f"{output.numel()} x {self.world_size}"
            )
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _DONE
        self.stats.record(CollectiveKind.REDUCE_SCATTER, tensor_nbytes(input))
        work = _reduce_scatter_single(output, input, group=self.group, async_op=async_op)
        return self._in_flight_handle(work, timed=False) if async_op else _DONE

    @recorded("all_gather")
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Handle:
        """Concatenate every rank's `input` into `output` (which may alias this rank's chunk)."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"all_gather: output has {output.numel()} elements, expected "
                f"{input.numel()} x {self.world_size}"
            )
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _DONE
        self.stats.record(CollectiveKind.ALL_GATHER, tensor_nbytes(output))
        work = _all_gather_single(output, input, group=self.group, async_op=async_op)
        return self._in_flight_handle(work) if async_op else _DONE

    @recorded("all_to_all")
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
    ) -> None:
        """Split `input` by `input_splits` and send split r to rank r; receive from each rank
        r its split for this rank into `output`, in rank order (`output_splits`).

        Every rank must pass splits that agree: what rank a sends rank b is what rank b
        expects from rank a.
        """
        if sum(input_splits) != input.numel() or sum(output_splits) != output.numel():
            raise ValueError(
                f"all_to_all: splits {input_splits} -> {output_splits} do not add up to the "
                f"tensors' {input.numel()} -> {output.numel()} elements"
            )
        if self.world_size == 1:
            output.copy_(input)
            return
        sent = sum(n for r, n in enumerate(input_splits) if r != self.rank)
        self.stats.record(CollectiveKind.ALL_TO_ALL, sent * input.element_size())
        dist.all_to_all_single(
            output,
            input,
            output_split_sizes=output_splits,
            input_split_sizes=input_splits,
            group=self.group,
        )

    @recorded("broadcast")
    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Handle:
        if self.world_size == 1:
            return _DONE
        self.stats.record(CollectiveKind.BROADCAST, tensor_nbytes(tensor))
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        work = dist.broadcast(tensor, src=global_src, group=self.group, async_op=async_op)
        return self._in_flight_handle(work) if async_op else _DONE

    # -- decisions ---------------------------------------------------------------

    def raise_if_any_failed(self, error: BaseException | None) -> None:
        """Agree on failure: if any rank has an error, every rank raises (none is left waiting).

        Every rank raises the same type with the same message: the first failing
        rank's error type (when it is a zerodp or built-in error type, re-created
        by name, never unpickled; else `AgreedError`) and its message, prefixed
        with that rank. The failing rank chains its original error as the cause.
        """
        report = None if error is None else (type(error).__name__, f"{error}")
        reports = self.all_gather_object(report)
        failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
        if not failed:
            return
        rank, (type_name, message) = failed[0]
        agreed_type = AGREED_TYPES.get(type_name, AgreedError)
        text = f"rank {rank}: {message}" if self.world_size > 1 else message
        agreed = agreed_type(text)
        if error is not None:
            raise agreed from error
        raise agreed

    @recorded("all_gather_object")
    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [pickle.loads(pickle.dumps(obj))]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    @recorded("broadcast_object")
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        dist.broadcast_object_list(box, src=global_src, group=self.group)
        return box[0]

    @recorded("barrier")
    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def broadcast_tensors(comm: Comm, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast each tensor from `src`, all in flight at once."""
    handles = [comm.broadcast(t, src=src, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()
