"""Moving the fragments of straddling tensors to their owners and back: two all-to-alls.

Inbound, before the step: every holder sends each owner its fragments of
the owner's tensors, gradients first, then the values of tensors whose
values are not resident everywhere (see `GroupLayout.values_resident`).
Outbound, after it: every owner sends each holder the stepped values of the
holder's fragments. The order inside each rank-to-rank split is the plan's
task order, which every rank knows, so the splits need no header. A step in
which the plan moves nothing issues no collective at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerodp.comm import Comm
from zerodp.optim.tensorwise.ownership import Fragment, TensorPlan, TensorTask

# The flat tensor of one group a fragment's offset indexes (by group order).
Source = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class _Piece:
    task: int  # index in the plan
    fragment: Fragment
    with_value: bool


class FragmentExchange:
    """The splits and offsets of the two all-to-alls for one rank, computed once."""

    def __init__(self, plan: TensorPlan, rank: int, comm: Comm, device: torch.device) -> None:
        self.plan = plan
        self.rank = rank
        self.comm = comm
        self.device = device
        world = plan.world_size
        # to_owners: what this rank sends each owner, and receives from each holder.
        self._sends: list[list[_Piece]] = [[] for _ in range(world)]
        self._receives: list[list[_Piece]] = [[] for _ in range(world)]
        for index, task in enumerate(plan.tasks):
            for fragment in task.remote_fragments():
                piece = _Piece(index, fragment, task.values_travel)
                if fragment.rank == rank:
                    self._sends[task.owner].append(piece)
                if task.owner == rank:
                    self._receives[fragment.rank].append(piece)
        self.active = plan.moves_anything

    # -- inbound: gradients (and values) to the owners --------------------------------

    def to_owners(
        self, grads: Source, values: Source, dtype: torch.dtype
    ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]]:
        """(task index, holder rank) -> (gradient piece, value piece or None), for every
        fragment this rank receives as an owner (views of one receive buffer)."""
        in_splits = [_split(pieces) for pieces in self._sends]
        out_splits = [_split(pieces) for pieces in self._receives]
        send = torch.empty(sum(in_splits), dtype=dtype, device=self.device)
        at = 0
        for pieces in self._sends:
            for piece in pieces:  # gradients first, then values
                at = _put(send, at, grads(self._group(piece)), piece.fragment)
            for piece in pieces:
                if piece.with_value:
                    at = _put(send, at, values(self._group(piece)), piece.fragment)
        received = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        self.comm.all_to_all(received, send, out_splits, in_splits)
        found: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        at = 0
        for holder, pieces in enumerate(self._receives):
            grads_at = {}
            for piece in pieces:
                grads_at[piece.task] = received[at : at + piece.fragment.numel]
                at += piece.fragment.numel
            for piece in pieces:
                value = None
                if piece.with_value:
                    value = received[at : at + piece.fragment.numel]
                    at += piece.fragment.numel
                found[(piece.task, holder)] = (grads_at[piece.task], value)
        return found

    # -- outbound: stepped values back to the holders ---------------------------------

    def to_holders(
        self,
        stepped: Callable[[int], torch.Tensor],
        write: Callable[[TensorTask, Fragment, torch.Tensor], None],
        dtype: torch.dtype,
    ) -> None:
        """Send each holder its fragments of this rank's stepped tensors (`stepped(task)`: the
        flattened tensor); `write` puts each received fragment into this rank's owned range."""
        in_splits = [sum(p.fragment.numel for p in pieces) for pieces in self._receives]
        out_splits = [sum(p.fragment.numel for p in pieces) for pieces in self._sends]
        send = torch.empty(sum(in_splits), dtype=dtype, device=self.device)
        at = 0
        for pieces in self._receives:
            for piece in pieces:
                fragment = piece.fragment
                send[at : at + fragment.numel].copy_(
                    stepped(piece.task)[fragment.start : fragment.end]
                )
                at += fragment.numel
        received = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        self.comm.all_to_all(received, send, out_splits, in_splits)
        at = 0
        for pieces in self._sends:
            for piece in pieces:
                numel = piece.fragment.numel
                write(self.plan.tasks[piece.task], piece.fragment, received[at : at + numel])
                at += numel

    def _group(self, piece: _Piece) -> int:
        return self.plan.tasks[piece.task].group


def _split(pieces: list[_Piece]) -> int:
    return sum(p.fragment.numel * (2 if p.with_value else 1) for p in pieces)


def _put(buffer: torch.Tensor, at: int, flat: torch.Tensor, fragment: Fragment) -> int:
    end = at + fragment.numel
    buffer[at:end].copy_(flat[fragment.offset : fragment.offset + fragment.numel])
    return end
