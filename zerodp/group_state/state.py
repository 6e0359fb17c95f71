"""`GroupState`, the one record per flat group, and `GroupIndex`, the one map to it.

See [Note: zerodp tensors] in `zerodp.group_state` for the words used here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from zerodp.comm import Comm
from zerodp.group_state.gather import GatherState, ParamStatus
from zerodp.group_state.kept_gradient import KeptGradient
from zerodp.group_state.optimizer_param import OptimizerParam
from zerodp.partition import FlatGroup


@dataclass(eq=False)
class GroupState:
    """Everything zerodp holds for one flat group.

    `order` is the group's place in the fixed order every rank issues its
    collectives in (reductions, gathers of several groups at once). `comm` is the
    group it is sharded over (the shard group; for expert slices the expert-data
    group): its gradients are reduced and its parameters gathered there.
    `grads` and `optim` exist for trainable groups, `gather` for sharded
    (stage 3, non-persistent) groups.
    """

    flat: FlatGroup
    order: int
    comm: Comm
    grads: KeptGradient | None = None
    optim: OptimizerParam | None = None
    gather: GatherState | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        return self.flat.params

    @property
    def names(self) -> list[str]:
        return self.flat.names

    @property
    def trainable(self) -> bool:
        return self.flat.trainable

    @property
    def persistent(self) -> bool:
        return self.flat.persistent

    @property
    def sharded_gather(self) -> GatherState:
        """The gather state of a group known to be sharded (stage 3, not persistent)."""
        if self.gather is None:  # pragma: no cover - callers hold sharded groups only
            raise RuntimeError(f"internal error: {self} is not sharded")
        return self.gather

    @property
    def status(self) -> ParamStatus:
        """Whether the full buffer is present now (a persistent group's always is)."""
        return ParamStatus.AVAILABLE if self.gather is None else self.gather.status

    @torch.no_grad()
    def write_param(self, position: int, value: torch.Tensor) -> None:
        """Give parameter `position` the full `value` everywhere this rank holds it.

        The full buffer (when allocated), a sharded group's shard and the
        optimizer copy each take their part; every rank passes the same value,
        so no communication is needed.
        """
        flat = self.flat
        start, end = flat.slot_of(position)
        flat_value = value.detach().reshape(-1)
        if flat.full_is_allocated:
            flat.full[start:end].copy_(flat_value.to(flat.full))
        if not flat.persistent:
            _write_part(flat.shard, flat.shard_range, start, end, flat_value)
        if self.gather is not None:
            self.gather.shard_changed()
        if self.optim is not None and self.optim.copy is not None:
            _write_part(self.optim.copy, flat.owned_range, start, end, flat_value)

    def value_of_owned(self) -> torch.Tensor:
        """The freshest values of what this rank owns: the optimizer's tensor, else the model's.

        A frozen sharded group has no optimizer parameter; its shard is what this
        rank holds.
        """
        if self.optim is not None:
            return self.optim.param.detach()
        return self.flat.owned

    def __repr__(self) -> str:
        return f"GroupState({self.order}: {self.flat!r}, {self.status.name})"


def _write_part(
    target: torch.Tensor, covers: tuple[int, int], start: int, end: int, value: torch.Tensor
) -> None:
    """Write the part of [start, end) that `target` (covering `covers` of the group) holds."""
    lo, hi = max(start, covers[0]), min(end, covers[1])
    if lo < hi:
        target[lo - covers[0] : hi - covers[0]].copy_(value[lo - start : hi - start].to(target))


class GroupIndex:
    """The engine's groups, in collective order, and the one map from a parameter to its group."""

    def __init__(self, states: list[GroupState] | None = None) -> None:
        self.states: list[GroupState] = []
        self._where: dict[int, tuple[GroupState, int]] = {}
        for state in states or []:
            self.add(state)

    def add(self, state: GroupState) -> None:
        self.states.append(state)
        for position, param in enumerate(state.params):
            self._where[id(param)] = (state, position)

    def remove(self, state: GroupState) -> None:
        """Forget a group (zero.Init made it whole again)."""
        self.states = [s for s in self.states if s is not state]
        for param in state.params:
            self._where.pop(id(param), None)

    def lookup(self, param: torch.Tensor) -> tuple[GroupState, int] | None:
        """(group, position in it) of a managed parameter; None for any other tensor."""
        found = self._where.get(id(param))
        if found is None or found[0].params[found[1]] is not param:
            return None  # another tensor that happens to reuse a dead parameter's id
        return found

    def state_of(self, param: torch.Tensor) -> GroupState | None:
        found = self.lookup(param)
        return None if found is None else found[0]

    def manages(self, param: torch.Tensor) -> bool:
        return self.lookup(param) is not None

    def __iter__(self) -> Iterator[GroupState]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    @property
    def trainable(self) -> list[GroupState]:
        return [s for s in self.states if s.trainable]

    @property
    def sharded(self) -> list[GroupState]:
        return [s for s in self.states if s.gather is not None]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for s in self.states for p in s.params]

    @property
    def trainable_params(self) -> list[nn.Parameter]:
        return [p for s in self.states if s.trainable for p in s.params]
