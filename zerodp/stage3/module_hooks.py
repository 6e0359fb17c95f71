"""Stage 3 hooks on every module: gather before use, release after, in forward and backward.

- forward pre-hook: the module's groups are gathered and held; in a forward
  re-run inside backward (activation checkpointing), the backward lifecycle
  observes first (every hook here goes through `BackwardLifecycle.hook`). A
  multi-grad hook on the module's inputs marks its post-backward.
- forward post-hook (also when forward raises): the holds are dropped; a
  multi-grad hook on the outputs marks the module's pre-backward.
- the root module also begins and ends the forward pass (releasing prefetched
  groups nobody used, and everything when its output has no graph: [Note: kept
  for the backward's head]); the saved-tensor hooks are installed by the scopes
  that hold groups ([Note: saving windows]).
- only the root and modules with sharded groups in their subtree are hooked
  (`hooked_modules`): the others have nothing to gather.
- a leaf module (see [Note: leaf modules]) gathers its whole subtree; while it
  runs, no hook of a module inside it does anything. Its inputs pass through
  `LeafEntry`, whose backward ends the leaf's backward.
- under `torch.compile`, see [Note: stage 3 under torch.compile]
  (`zerodp.stage3.compiled`).
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp._tree import grad_tensors_in
from zerodp.backward import autograd_api
from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.stage3.compiled import UnitDepth, run_eagerly
from zerodp.stage3.coordinator import ParamCoordinator
from zerodp.stage3.forward_graphs import graph_nodes
from zerodp.stage3.leaf import enter_leaf
from zerodp.stage3.module_groups import ModuleGroups
from zerodp.torch_internals import forward_raised


class HookRole(enum.Enum):
    """What a hooked module's forward hooks do; chosen once per module, at install."""

    GATHERS = "gathers"  # the root, or a module with sharded groups of its own
    LEAF = "leaf"  # a leaf module: gathers its whole subtree, whose hooks then do nothing
    INNER = "inner"  # groups only further down: under trace it does nothing at all


class Stage3ModuleHooks:
    """Forward pre/post hooks on every module of one model, and the backward hooks they add."""

    def __init__(
        self,
        root: nn.Module,
        coordinator: ParamCoordinator,
        module_groups: ModuleGroups,
        lifecycle: BackwardLifecycle,
    ) -> None:
        self.root = root
        self.coordinator = coordinator
        self.module_groups = module_groups
        self.lifecycle = lifecycle
        self._active_leaves: list[nn.Module] = []  # leaves whose forward is running, innermost last
        self._pre_backward = lifecycle.hook(coordinator.pre_backward)
        self._post_backward = lifecycle.hook(coordinator.post_backward)
        self._end_leaf_backward = lifecycle.hook(coordinator.end_leaf_backward)

    def hooked_modules(self) -> list[nn.Module]:
        """The root, and every module with a sharded group in its subtree.

        A module with none (an activation, a dropout, a module inside a stage 3 unit)
        has nothing to gather: should it read another module's parameter, the nearest
        hooked module around it gathers that on use, as its own.
        """
        owns = self.module_groups.owns_any
        return [
            m for m in self.root.modules() if m is self.root or any(owns(x) for x in m.modules())
        ]

    def install(self) -> list[RemovableHandle]:
        """One pre- and one post-hook per module, chosen once by what the module is, so that
        dynamo compiles each hook at most once per module class (no per-module guards)."""
        handles = []
        self._observed_pre = self.lifecycle.hook(self._pre_forward)
        self._eager_pre = run_eagerly(self._observed_pre)
        self._eager_post = run_eagerly(self._post_forward)
        inside_leaves = {
            id(m)
            for leaf in self.root.modules()
            if self.module_groups.leaves.is_leaf(leaf)
            for m in leaf.modules()
            if m is not leaf
        }
        hooks = {
            HookRole.GATHERS: (self._pre_hook, self._post_hook),
            HookRole.LEAF: (self._pre_hook, self._post_hook_leaf),
            HookRole.INNER: (self._pre_hook_inner, self._post_hook_inner),
        }
        for module in self.hooked_modules():
            pre, post = hooks[self._role_of(module)]
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(
                module.register_forward_hook(
                    post,
                    with_kwargs=True,
                    # Inside a leaf the post-hook does nothing (the leaf's own always runs);
                    # `always_call` there would make dynamo guard each module's hook id, a
                    # recompile for every block (a raising forward's scopes are unwound).
                    always_call=id(module) not in inside_leaves,
                )
            )
        return handles

    def _role_of(self, module: nn.Module) -> HookRole:
        if self.module_groups.leaves.is_leaf(module):
            return HookRole.LEAF
        if module is self.root or self.module_groups.gathers_any(module):
            return HookRole.GATHERS
        return HookRole.INNER

    def _push_leaf(self, leaf: nn.Module) -> None:
        """A leaf's forward starts; `UnitDepth` tells traced hooks a leaf is running."""
        self._active_leaves.append(leaf)
        UnitDepth.leaves = len(self._active_leaves)

    def _pop_leaf(self) -> None:
        self._active_leaves.pop()
        UnitDepth.leaves = len(self._active_leaves)

    def _clear_leaves(self) -> None:
        """A new forward: drop what a forward that died inside a leaf left."""
        self._active_leaves.clear()
        UnitDepth.leaves = 0

    # While dynamo traces a forward (see [Note: stage 3 under torch.compile]), a module that
    # gathers breaks the graph and runs its hook eagerly, unless a leaf is running (then the
    # leaf's whole subtree is gathered and the hook does nothing); a module that gathers
    # nothing does nothing. Outside compiled code every hook runs as it always does.

    def _pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return None if UnitDepth.leaves else self._eager_pre(module, args, kwargs)
        return self._observed_pre(module, args, kwargs)

    def _pre_hook_inner(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return self._observed_pre(module, args, kwargs)

    def _post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            if not UnitDepth.leaves:
                self._eager_post(module, args, kwargs, output)
            return
        self._post_forward(module, args, kwargs, output)

    def _post_hook_leaf(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            self._eager_post(module, args, kwargs, output)
            return
        self._post_forward(module, args, kwargs, output)

    def _post_hook_inner(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self._post_forward(module, args, kwargs, output)

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        starts_forward = module is self.root and not autograd_api.in_backward()
        if starts_forward:
            self._clear_leaves()
        elif self._active_leaves:
            return None  # inside a leaf: its whole subtree is gathered already
        if starts_forward:
            self.coordinator.begin_forward()
        self.coordinator.pre_forward(module)
        leaf = self.module_groups.leaves.is_leaf(module)
        if leaf:
            self._push_leaf(module)
        if torch.is_grad_enabled() and self.module_groups.gathers_any(module):
            if leaf:
                entered = enter_leaf(args, kwargs, lambda: self._end_leaf_backward(module))
                if entered is not None:
                    return entered
            inputs = grad_tensors_in((args, kwargs))
            if inputs:
                # "all" waits for every input's gradient; autograd.grad cannot track leaf
                # tensors that way, so with a leaf input the first gradient marks the end
                # (a parameter still needed after that is gathered again on unpack).
                mode: Literal["any", "all"] = (
                    "any" if any(t.grad_fn is None for t in inputs) else "all"
                )
                end = self._end_leaf_backward if leaf else self._post_backward
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, lambda grads: end(module), mode=mode
                )
        return None

    def _post_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if self._active_leaves:
            if module is not self._active_leaves[-1]:
                return  # a module inside the running leaf
            self._pop_leaf()
        self.coordinator.post_forward(module)
        if (
            output is not None
            and torch.is_grad_enabled()
            and self.module_groups.gathers_any(module)
        ):
            outputs = grad_tensors_in(output)
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grad: self._pre_backward(module), mode="any"
                )
        if module is self.root and not autograd_api.in_backward():
            error = forward_raised()
            if error is None:
                # A backward can come only through the output's graph (none: frozen, no_grad).
                graph = graph_nodes(grad_tensors_in(output)) if torch.is_grad_enabled() else []
                self.coordinator.end_forward(graph)
            else:  # the forward is dying: its pass must not look complete to the other ranks
                self.coordinator.fail_forward(error)
