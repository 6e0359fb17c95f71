"""Who steps which tensor, and which pieces travel: arithmetic on the flat layouts.

Every rank computes the same plan from the same layouts, so the exchange
needs no negotiation: what rank a sends rank b is what b expects from a.

A tensor of a flat group is held in pieces (`Fragment`s): each rank's owned
range holds the part of the tensor inside that rank's shard. Shards are
contiguous, so only a tensor that straddles a shard boundary has more than
one holder; one larger than a shard has ranks wholly inside it. Each tensor
gets one owner, which assembles it, steps it and sends the pieces back:

- `OwnerPlacement.HOLDERS` (the default): the owner is one of the tensor's
  holders. A tensor inside one shard is stepped where it lies, with no
  communication; a straddling one goes to the holder with the least update
  cost so far (ties: the one holding most of it), tensors taken from the
  costliest down. Only straddling tensors move.
- `OwnerPlacement.BALANCED`: any rank may own any tensor; tensors go, costliest
  first, to the rank with the least cost so far (an all-to-all of nearly
  every tensor, for the best balance of update work).
- `OwnerPlacement.REPLICATED` (stage 0): every rank holds every tensor and steps
  all of them, as stage 0 replicates the optimizer state; nothing moves.

The update cost of a tensor is `update_cost(shape)`: rows x cols x min(rows,
cols) for a matrix (a Newton-Schulz iteration's matrix products), the
element count for a vector. The bench measures both placements
(bench/optimizers.py, docs/optimizers.md).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zerodp.partition.layout import FlatLayout

ALL_RANKS = -1  # the owner of a replicated tensor: every rank


class OwnerPlacement(enum.Enum):
    HOLDERS = "holders"
    BALANCED = "balanced"
    REPLICATED = "replicated"


@dataclass(frozen=True)
class Fragment:
    """The part `[start, end)` of a flattened tensor that `rank`'s owned range holds at
    `offset` (replicated tensors: one fragment, rank `ALL_RANKS`, the whole tensor)."""

    rank: int
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class GroupLayout:
    """What the plan needs of one flat group whose optimizer steps whole tensors.

    `values_resident`: every rank's full buffer holds the very values the
    optimizer steps (a persistent group without an optimizer copy), so an owner
    reads the values of a whole tensor there and only gradients travel in.
    """

    order: int
    names: tuple[str, ...]
    layout: FlatLayout
    owns_full: bool
    values_resident: bool


@dataclass(frozen=True)
class TensorTask:
    """One tensor of the plan: where it lies, who steps it, in which shape."""

    group: int  # GroupState.order
    position: int  # in the group
    name: str
    shape: tuple[int, ...]  # the parameter's shape
    step_shape: tuple[int, ...]  # the shape the optimizer sees (a matrix view, or `shape`)
    owner: int
    fragments: tuple[Fragment, ...]
    values_travel: bool
    cost: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def fragment_of(self, rank: int) -> Fragment | None:
        for fragment in self.fragments:
            if fragment.rank in (rank, ALL_RANKS):
                return fragment
        return None

    def owned_by(self, rank: int) -> bool:
        return self.owner in (rank, ALL_RANKS)

    def is_local(self, rank: int) -> bool:
        """Stepped by `rank` as a view of its own owned range: nothing to assemble."""
        return self.owned_by(rank) and len(self.fragments) == 1

    def remote_fragments(self) -> list[Fragment]:
        """The fragments held by other ranks than the owner (what travels)."""
        return [f for f in self.fragments if f.rank not in (self.owner, ALL_RANKS)]


@dataclass(frozen=True)
class TensorPlan:
    tasks: tuple[TensorTask, ...]
    world_size: int
    placement: OwnerPlacement

    def owned_by(self, rank: int) -> list[TensorTask]:
        return [t for t in self.tasks if t.owned_by(rank)]

    def task_of(self, group: int, position: int) -> TensorTask | None:
        for task in self.tasks:
            if (task.group, task.position) == (group, position):
                return task
        return None

    @property
    def moves_anything(self) -> bool:
        return any(t.remote_fragments() for t in self.tasks)

    def elements_in(self) -> int:
        """Elements sent to owners per step, over all ranks (gradients, and values that travel)."""
        return sum(
            f.numel * (2 if t.values_travel else 1)
            for t in self.tasks
            for f in t.remote_fragments()
        )

    def elements_out(self) -> int:
        """Elements of stepped values sent back to their holders per step, over all ranks."""
        return sum(f.numel for t in self.tasks for f in t.remote_fragments())

    def cost_by_rank(self) -> list[float]:
        costs = [0.0] * self.world_size
        for task in self.tasks:
            for rank in range(self.world_size) if task.owner == ALL_RANKS else [task.owner]:
                costs[rank] += task.cost
        return costs


def update_cost(shape: Sequence[int]) -> float:
    """The work of one update of a tensor of `shape` (see the module docstring)."""
    numel = math.prod(shape)
    if len(shape) < 2 or numel == 0:
        return float(numel)
    rows = shape[0]
    return float(numel * min(rows, numel // rows))


def matrix_view(shape: Sequence[int]) -> tuple[int, ...]:
    """A tensor of more than two dimensions as a matrix (its first dimension by the rest),
    as convolution filters are orthogonalized; others as they are."""
    if len(shape) <= 2:
        return tuple(shape)
    return (shape[0], math.prod(shape[1:]))


def build_plan(
    groups: Sequence[GroupLayout],
    placement: OwnerPlacement,
    step_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> TensorPlan:
    """The plan for `groups` (in collective order); every rank gets the same one."""
    if not groups:
        return TensorPlan((), 1, placement)
    world_size = groups[0].layout.world_size
    if any(g.owns_full for g in groups):
        placement = OwnerPlacement.REPLICATED
    drafts = [
        _draft(g, position, world_size, placement, step_shapes or {})
        for g in groups
        for position in range(len(g.names))
    ]
    owners = _assign(drafts, world_size, placement)
    tasks = tuple(
        TensorTask(
            group=d.group,
            position=d.position,
            name=d.name,
            shape=d.shape,
            step_shape=d.step_shape,
            owner=owner,
            fragments=d.fragments,
            values_travel=not d.values_resident,
            cost=d.cost,
        )
        for d, owner in zip(drafts, owners, strict=True)
    )
    return TensorPlan(tasks, world_size, placement)


@dataclass(frozen=True)
class _Draft:
    group: int
    position: int
    name: str
    shape: tuple[int, ...]
    step_shape: tuple[int, ...]
    fragments: tuple[Fragment, ...]
    values_resident: bool
    cost: float


def _draft(
    group: GroupLayout,
    position: int,
    world_size: int,
    placement: OwnerPlacement,
    step_shapes: Mapping[str, tuple[int, ...]],
) -> _Draft:
    slot = group.layout.slots[position]
    name = group.names[position]
    step_shape = tuple(step_shapes.get(name, slot.shape))
    if math.prod(step_shape) != slot.numel:
        raise ValueError(f"{name}: step shape {step_shape} does not hold its {slot.numel} elements")
    if placement is OwnerPlacement.REPLICATED:
        fragments: tuple[Fragment, ...] = (Fragment(ALL_RANKS, 0, slot.numel, slot.offset),)
    else:
        found = []
        for rank in range(world_size):
            overlap = group.layout.overlap(position, rank)
            if overlap is not None:
                found.append(
                    Fragment(rank, overlap.param_start, overlap.param_end, overlap.shard_start)
                )
        fragments = tuple(found)
    return _Draft(
        group=group.order,
        position=position,
        name=name,
        shape=slot.shape,
        step_shape=step_shape,
        fragments=fragments,
        values_resident=group.values_resident,
        cost=update_cost(step_shape),
    )


def _assign(drafts: list[_Draft], world_size: int, placement: OwnerPlacement) -> list[int]:
    if placement is OwnerPlacement.REPLICATED:
        return [ALL_RANKS] * len(drafts)
    owners: list[int | None] = [None] * len(drafts)
    load = [0.0] * world_size
    if placement is OwnerPlacement.HOLDERS:
        for index, draft in enumerate(drafts):
            if len(draft.fragments) == 1:  # inside one shard: stepped where it lies
                owners[index] = draft.fragments[0].rank
                load[draft.fragments[0].rank] += draft.cost
    rest = sorted(
        (i for i, owner in enumerate(owners) if owner is None),
        key=lambda i: (-drafts[i].cost, i),
    )
    for index in rest:
        draft = drafts[index]
        held = {f.rank: f.numel for f in draft.fragments}
        candidates = list(held) if placement is OwnerPlacement.HOLDERS else list(range(world_size))
        if not candidates:  # an empty tensor has no holder; its (no-op) step goes to rank 0
            candidates = [0]
        owner = min(candidates, key=lambda r: (load[r], -held.get(r, 0), r))
        owners[index] = owner
        load[owner] += draft.cost
    return [o if o is not None else 0 for o in owners]
