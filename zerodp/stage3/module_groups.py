"""Which sharded groups each module gathers: its own, a leaf's whole subtree's, those it uses.

A module's own groups are known at start-up (the groups its direct
parameters are in). Two things add to them while training runs:

- a leaf module ([Note: leaf modules]) gathers the groups of every module in
  its subtree, as one unit;
- a module seen reading another module's group (a parent using a child's
  weight, a tied weight read outside its module) is remembered as a user of
  it, so that later forwards gather that group up front, with the module's
  own, and its backward gathers it too.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from zerodp.group_state import GroupState
from zerodp.stage3.leaf import LeafPlan


class ModuleGroups:
    """The sharded groups gathered for each module of one model."""

    def __init__(
        self,
        root: nn.Module,
        own: dict[nn.Module, list[GroupState]],
        *,
        on_leaves_change: Callable[[frozenset[GroupState]], None] | None = None,
    ) -> None:
        self._own = {m: list(states) for m, states in own.items()}
        # `on_leaves_change` gets the groups inside leaves whenever leaves are (re)marked.
        self.leaves = LeafPlan(root, self._own, on_change=on_leaves_change)
        self._used: dict[nn.Module, list[GroupState]] = {}  # other modules' groups it reads

    def gathered_for(self, module: nn.Module) -> list[GroupState]:
        """The groups gathered for `module`: its own (a leaf's whole subtree's), and those
        of other modules it was seen using."""
        if self.leaves.is_leaf(module):
            direct = self.leaves.subtree_groups(module)
        else:
            direct = self._own.get(module, [])
        used = self._used.get(module)
        return direct + used if used else direct

    def owns_any(self, module: nn.Module) -> bool:
        """Whether `module` has sharded groups of its own (a unit: its subtree's)."""
        return bool(self._own.get(module))

    def gathers_any(self, module: nn.Module) -> bool:
        """Whether anything is gathered for `module` (`gathered_for` is not empty)."""
        if self._used.get(module):
            return True
        if self.leaves.is_leaf(module):
            return bool(self.leaves.subtree_groups(module))
        return bool(self._own.get(module))

    def remember_use(self, module: nn.Module, state: GroupState) -> None:
        """`module`'s forward read `state`: gather it for `module` from now on."""
        if state in self._own.get(module, []):
            return
        used = self._used.setdefault(module, [])
        if state not in used:
            used.append(state)
