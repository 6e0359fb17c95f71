"""Typed collectives over one process group: `Comm`, zerodp's one way to `torch.distributed`.

Each collective counts its bytes (`zerodp.comm.stats`), is recorded so that a failure
names it, and is waited for through a `Handle` that hears from the other ranks while it
lasts (`zerodp.comm.handles`); what a failure means, and what the group does then, is
failure handling's (`zerodp.comm.faults`), which this module calls and never the reverse.

A `Comm` over a subgroup (a shard, replica or hpZ group, see
`zerodp.comm.subgroups`) is made with `parent=` the engine's `Comm`: it counts
into the parent's `CommStats` under its own `label`, so the totals stay in one
place and each collective's group can still be told apart.
"""

from __future__ import annotations

import pickle
import weakref
from typing import Any

import torch
import torch.distributed as dist

from zerodp.comm import object_collectives
from zerodp.comm.agreement import agreement
from zerodp.comm.faults.collective_history import CollectiveHistory, recorded
from zerodp.comm.faults.failure_notices import (
    FailureBoard,
    FailureNotice,
    one_per_rank,
    peer_failed_error,
    read_exits,
)
from zerodp.comm.faults.polled_waits import OnStall
from zerodp.comm.faults.teardown import abandon, abort_group, register
from zerodp.comm.faults.uneven_inputs import uneven_inputs_error, whereabouts
from zerodp.comm.handles import DONE, Handle
from zerodp.comm.single_tensor import all_gather_single, reduce_scatter_single
from zerodp.comm.stats import WORLD, CollectiveKind, CommStats, tensor_nbytes
from zerodp.errors import AGREED_TYPES, AgreedError, CollectiveError


def _is_gloo(group: Any) -> bool:
    """Whether `group` runs every collective on gloo (whose waits zerodp can poll)."""
    return str(dist.get_backend(group)) == "gloo"


class Comm:
    """The collectives of one process group (the default group unless given).

    With `parent`, a subgroup's collectives: counted in the parent's stats under `label`,
    waited for with the parent's `on_stall` unless given its own, recorded in the parent's
    history (one numbering, world ranks in messages; a failure in any of the groups aborts
    all of them and refuses every later collective), and failures read the parent's
    failure notices. `stall_checks`: on gloo, a wait that lasts hears what other ranks
    posted (see [Note: uneven inputs] in `zerodp.comm.faults.uneven_inputs`).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        label: str = WORLD,
        parent: Comm | None = None,
        stall_checks: bool = True,
    ) -> None:
        self.group = group
        self.label = label
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._parent = parent
        self.stats: CommStats = parent.stats if parent is not None else CommStats()
        # Called while a collective waits long (gloo only: an NCCL wait returns at once);
        # the collective order check (zerodp.comm.faults.collective_order) adds its own
        # checks. A subgroup uses its parent's unless given its own.
        watch = parent is None and stall_checks and self.world_size > 1 and _is_gloo(group)
        self._on_stall: OnStall | None = self._check_stall if watch else None
        self.watches_stalls = watch  # and so agrees ([Note: agreeing before a collective])
        # Pass notices of the order check beside the process's exit notices.
        self.failure_boards: list[FailureBoard] = (
            parent.failure_boards if parent is not None else []
        )
        # For errors that name the collective; the first one aborts the group(s).
        self._children: list[Comm] = []
        if parent is not None:
            parent._children.append(self)
            self.history: CollectiveHistory = parent.history
        else:
            self.history = CollectiveHistory(
                self.rank, on_failure=self._abort_group, explain=self.explain_failure
            )
        # Collectives issued with async_op and not yet waited for (prefetched gathers,
        # the reducer's reductions): what the teardown at exit must not leave pending.
        self._in_flight: weakref.WeakSet[Handle] = weakref.WeakSet()
        register(self)  # see [Note: ending the process] in zerodp.comm.faults.teardown

    @property
    def on_stall(self) -> OnStall | None:
        """Called while a collective waits long (set by the collective order check; gloo only)."""
        if self._on_stall is None and self._parent is not None:
            return self._parent.on_stall
        return self._on_stall

    @on_stall.setter
    def on_stall(self, value: OnStall | None) -> None:
        self._on_stall = value

    def global_rank(self, group_rank: int) -> int:
        """The default group's rank of this group's rank `group_rank`."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _abort_group(self) -> None:
        """A collective failed (a peer died or froze): abort the process group.

        Its other in-flight collectives then fail at once instead of waiting out their
        timeouts, and none is left pending when the process exits (see [Note: ending the
        process] in zerodp.comm.faults.teardown). A peer that failed leaves every group of
        this `Comm` suspect: its subgroups are aborted too.
        """
        abort_group(self.group)
        self._abort_children()

    def _abort_children(self) -> None:
        for child in self._children:
            abort_group(child.group)

    def failure_notices(self) -> list[FailureNotice]:
        """What ranks that failed posted ([Note: failure notices]); read only on a failure."""
        notices = [notice for board in self.failure_boards for notice in board.read()]
        return one_per_rank(notices + read_exits())

    def explain_failure(self, waiting_in: str) -> CollectiveError | None:
        """Why the collective `waiting_in` (as `CollectiveHistory.waiting_in` names it)
        failed, when another rank said: it failed ([Note: failure notices]), or it is
        somewhere else ([Note: uneven inputs]). None: nobody said."""
        notices = self.failure_notices()
        if notices:
            return peer_failed_error(notices, f"collective {waiting_in}")
        places = whereabouts().peers_elsewhere(waiting_in)
        if places:
            return uneven_inputs_error(places)
        return None

    def agree_first(self, kind: str, label: str | None = None) -> None:
        """Before a collective (`kind`, in this group or the one labelled `label`): if this
        rank began an activity since the last one, agree on it with every rank (see [Note:
        agreeing before a collective])."""
        root = self if self._parent is None else self._parent
        if root.watches_stalls:
            agreement().before(root, kind, self.label if label is None else label)

    def _check_stall(self) -> None:
        """A wait lasts: say where this rank is, and stop if another rank is stuck elsewhere."""
        whereabouts().on_stall(self.history.waiting_in(), self._abort_for_uneven_inputs)

    def _recovered(self) -> None:
        whereabouts().recovered()

    def _abort_for_uneven_inputs(self) -> None:
        why = "uneven inputs (the ranks are stuck in different places)"
        self.history.mark_broken(why)
        abandon(self.group, why)
        self._abort_children()

    def has_in_flight(self) -> bool:
        """Whether a collective this `Comm` issued asynchronously has not been waited for."""
        return any(not handle.done for handle in list(self._in_flight))

    def _polled(self, async_op: bool) -> bool:
        """Issue asynchronously when the caller waits at once but a stall must be heard."""
        return async_op or self.on_stall is not None

    def _finish(self, work: Any, async_op: bool, timed: bool = True) -> Handle:
        """The handle for an `async_op` caller; otherwise wait here (polled if issued so)."""
        if async_op:
            return self._in_flight_handle(work, timed)
        if work is not None:
            Handle(work, self.on_stall, timed=timed, on_recover=self._recovered).wait()
        return DONE

    def _in_flight_handle(self, work: Any, timed: bool = True) -> Handle:
        handle = Handle(work, self.on_stall, timed=timed, on_recover=self._recovered)
        self._in_flight.add(handle)
        return handle

    # -- tensors -----------------------------------------------------------------

    @recorded("all_reduce")
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle:
        if self.world_size == 1:
            return DONE
        self.stats.record(CollectiveKind.ALL_REDUCE, tensor_nbytes(tensor), self.label)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        polled = self._polled(async_op)
        work = dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=polled)
        return self._finish(work, async_op)

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
            return DONE
        self.stats.record(CollectiveKind.REDUCE_SCATTER, tensor_nbytes(input), self.label)
        work = reduce_scatter_single(
            output, input, group=self.group, async_op=self._polled(async_op)
        )
        return self._finish(work, async_op, timed=False)

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
            return DONE
        self.stats.record(CollectiveKind.ALL_GATHER, tensor_nbytes(output), self.label)
        work = all_gather_single(output, input, group=self.group, async_op=self._polled(async_op))
        return self._finish(work, async_op)

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
        self.stats.record(CollectiveKind.ALL_TO_ALL, sent * input.element_size(), self.label)
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
            return DONE
        self.stats.record(CollectiveKind.BROADCAST, tensor_nbytes(tensor), self.label)
        global_src = self.global_rank(src)
        work = dist.broadcast(
            tensor, src=global_src, group=self.group, async_op=self._polled(async_op)
        )
        return self._finish(work, async_op)

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
        if self.on_stall is not None:  # gloo: polled, so that a stall is heard
            return object_collectives.gather_objects(obj, self.group, self.world_size, self._finish)
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    @recorded("broadcast_object")
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        global_src = self.global_rank(src)
        if self.on_stall is not None:  # gloo: polled, so that a stall is heard
            return object_collectives.broadcast_object(obj, global_src, self.group, self._finish)
        box = [obj]
        dist.broadcast_object_list(box, src=global_src, group=self.group)
        return box[0]

    @recorded("barrier")
    def barrier(self) -> None:
        if self.world_size > 1:
            self._finish(dist.barrier(group=self.group, async_op=self._polled(False)), False)


def broadcast_tensors(comm: Comm, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast each tensor from `src`, all in flight at once."""
    handles = [comm.broadcast(t, src=src, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()
