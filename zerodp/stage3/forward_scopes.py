"""The forward scopes running now: whose module, which groups each holds and claims, its window.

A forward scope is one module's forward, from its pre-hook to its post-hook
(`ParamCoordinator.pre_forward` / `post_forward`). While it runs it holds the
groups it reads and claims them, so they keep the plain parameter class, and
it runs with the saved-tensor hooks installed ([Note: saving windows], in
`zerodp.stage3.saved_tensors`). Scopes nest as modules call each other; the
innermost one claims a group that a torch operation reads on the way
(`ZeroParameter`, through `ParamCoordinator.before_use`).

A forward re-run inside backward (activation checkpointing) opens a scope too,
marked `in_backward`: it claims nothing, since the backward about to run
needs the parameters and releases them itself.

What to gather for a scope and when to release what it held is the
coordinator's; this module only keeps the bookkeeping straight, also when a
forward raises part-way and leaves scopes behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from zerodp.group_state import GroupState


class SavingWindows(Protocol):
    """The saved-tensor hooks, as forward scopes install them ([Note: saving windows])."""

    def push_if_possible(self) -> bool: ...

    def pop(self) -> None: ...


@dataclass
class ForwardScope:
    """One module's running forward."""

    module: nn.Module
    in_backward: bool  # a forward re-run inside backward: it holds and claims nothing
    held: list[GroupState] = field(default_factory=list)
    saving: bool = False  # this scope installed the saved-tensor hooks


class ForwardScopes:
    """The stack of running forward scopes of one engine, innermost last."""

    def __init__(self, states: list[GroupState], windows: SavingWindows) -> None:
        self.states = states
        self.windows = windows
        self._stack: list[ForwardScope] = []

    @property
    def innermost(self) -> ForwardScope | None:
        return self._stack[-1] if self._stack else None

    def begin_pass(self) -> None:
        """A forward pass starts: a gathered group that no scope claims keeps the guarded
        class from now on, so that whatever reads it is claimed by a scope first."""
        for state in self.states:
            state.sharded_gather.set_forward_pass(True)

    def end_pass(self) -> None:
        for state in self.states:
            state.sharded_gather.set_forward_pass(False)

    def enter(self, module: nn.Module, *, in_backward: bool) -> ForwardScope:
        scope = ForwardScope(module, in_backward=in_backward)
        self._stack.append(scope)
        return scope

    def claim(self, scope: ForwardScope, state: GroupState) -> None:
        """`scope` (a forward's, gathered) reads `state` until it ends: hold and claim it,
        and make sure the scope saves through the saved-tensor hooks."""
        gather = state.sharded_gather
        gather.hold()
        gather.claim()
        scope.held.append(state)
        if not scope.saving:
            scope.saving = self.windows.push_if_possible()

    def unwind_to(self, module: nn.Module) -> list[ForwardScope]:
        """Close the scopes above `module`'s, which a forward that raised part-way left
        behind (all of them, if `module` has none); returns them, closed."""
        closed = []
        while self._stack and self._stack[-1].module is not module:
            scope = self._stack.pop()
            self._close(scope)
            closed.append(scope)
        return closed

    def leave(self) -> ForwardScope | None:
        """Close the innermost scope and return it (None when no scope runs)."""
        if not self._stack:
            return None
        scope = self._stack.pop()
        self._close(scope)
        return scope

    def close_all(self) -> None:
        """A forward or backward died part-way: close every scope, innermost first."""
        while self._stack:
            self._close(self._stack.pop())

    def _close(self, scope: ForwardScope) -> None:
        """`scope` ends: drop its holds and claims, and the saved-tensor hooks it installed."""
        for state in scope.held:
            state.sharded_gather.unhold()
            state.sharded_gather.unclaim()
        if scope.saving:
            self.windows.pop()
            scope.saving = False
