"""Stage 3 hooks on every module: gather before use, release after, in forward and backward.

- forward pre-hook: the module's groups are gathered and held; in a forward
  re-run inside backward (activation checkpointing), the backward lifecycle
  observes first (every hook here goes through `BackwardLifecycle.hook`). A
  multi-grad hook on the module's inputs marks its post-backward.
- forward post-hook (also when forward raises): the holds are dropped; a
  multi-grad hook on the outputs marks the module's pre-backward.
- the root module also installs the saved-tensor hooks for the forward and
  ends the forward pass (releasing prefetched groups nobody used).
- a leaf module (see [Note: leaf modules]) gathers its whole subtree; while it
  runs, no hook of a module inside it does anything. Its inputs pass through
  `LeafEntry`, whose backward ends the leaf's backward.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp._tree import grad_tensors_in
from zerodp.backward import autograd_api
from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.params.coordinator import ParamCoordinator
from zerodp.params.leaf import enter_leaf
from zerodp.params.saved_tensors import SavedTensorGatherer


class Stage3ModuleHooks:
    """Forward pre/post hooks on every module of one model, and the backward hooks they add."""

    def __init__(
        self,
        root: nn.Module,
        coordinator: ParamCoordinator,
        lifecycle: BackwardLifecycle,
        saved_tensors: SavedTensorGatherer,
    ) -> None:
        self.root = root
        self.coordinator = coordinator
        self.lifecycle = lifecycle
        self.saved_tensors = saved_tensors
        self._root_pushed: list[bool] = []
        self._active_leaves: list[nn.Module] = []  # leaves whose forward is running, innermost last
        self._pre_backward = lifecycle.hook(coordinator.pre_backward)
        self._post_backward = lifecycle.hook(coordinator.post_backward)
        self._end_leaf_backward = lifecycle.hook(coordinator.end_leaf_backward)

    def install(self) -> list[RemovableHandle]:
        handles = []
        pre_forward = self.lifecycle.hook(self._pre_forward)
        for module in self.root.modules():
            handles.append(module.register_forward_pre_hook(pre_forward, with_kwargs=True))
            handles.append(
                module.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
            )
        return handles

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        starts_forward = module is self.root and not autograd_api.in_backward()
        if starts_forward:
            self._active_leaves.clear()  # left by a forward that died inside a leaf
        elif self._active_leaves:
            return None  # inside a leaf: its whole subtree is gathered already
        if starts_forward:
            self._root_pushed.append(self.saved_tensors.push_if_possible())
            self.coordinator.begin_forward()
        self.coordinator.pre_forward(module)
        leaf = self.coordinator.leaves.is_leaf(module)
        if leaf:
            self._active_leaves.append(module)
        if torch.is_grad_enabled() and self.coordinator.has_groups(module):
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
            self._active_leaves.pop()
        self.coordinator.post_forward(module)
        if output is not None and torch.is_grad_enabled() and self.coordinator.has_groups(module):
            outputs = grad_tensors_in(output)
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grad: self._pre_backward(module), mode="any"
                )
        if module is self.root and not autograd_api.in_backward():
            self.coordinator.end_forward(backward_follows=torch.is_grad_enabled())
            if self._root_pushed and self._root_pushed.pop():
                self.saved_tensors.pop()
