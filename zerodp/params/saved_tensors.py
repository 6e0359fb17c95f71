"""Saved-tensor hooks that gather a stage 3 parameter when autograd unpacks it.

Module hooks gather a module's parameters before its backward, which covers
the common case. These hooks cover every other one, whatever the graph: a
saved tensor is recognised as (a view of) a sharded parameter by its storage
(see [Note: stage 3 storage]), and the parameter's group is gathered when
autograd unpacks it. This is what makes double backward work: the graph
built by `torch.autograd.grad(..., create_graph=True)` reads parameters
outside any module's own backward, after the first-order pass released them.
In such a task (grad mode on) the unpacked parameter is returned as a copy,
so the higher-order graph owns what it saves and never reads storage that a
later release frees.

Packing returns a detached alias, never the tensor itself: a saved output
that pointed back at its own grad_fn would form a reference cycle that the
garbage collector cannot see.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.backward import autograd_api
from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.group import GroupState
from zerodp.params.coordinator import ParamCoordinator
from zerodp.torch_internals import storage_key


class _SavedParameterView:
    __slots__ = ("state", "tensor")

    def __init__(self, state: GroupState, tensor: torch.Tensor) -> None:
        self.state = state
        self.tensor = tensor


class SavedTensorGatherer:
    """The pack/unpack pair installed around each forward (see the module docstring)."""

    def __init__(self, coordinator: ParamCoordinator, lifecycle: BackwardLifecycle) -> None:
        self.coordinator = coordinator
        self.unpack = lifecycle.hook(self._unpack)
        self._contexts: list[torch.autograd.graph.saved_tensors_hooks] = []

    def pack(self, tensor: torch.Tensor) -> Any:
        detached = tensor.detach()
        state = self.coordinator.state_of_storage(storage_key(tensor))
        if state is None:
            return detached
        return _SavedParameterView(state, detached)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _SavedParameterView):
            return packed
        self.coordinator.ensure_available_for_unpack(packed.state)
        if torch.is_grad_enabled():
            return packed.tensor.clone()
        return packed.tensor

    def push_if_possible(self) -> bool:
        """Install the hooks for a forward, unless other saved-tensor hooks are active.

        Non-reentrant activation checkpointing installs its own hooks; those must
        keep working (they recompute, and the recomputation gathers through the
        module hooks), so zerodp's step aside there.
        """
        if autograd_api.saved_tensor_hooks_active():
            return False
        context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        context.__enter__()
        self._contexts.append(context)
        return True

    def pop(self) -> None:
        if self._contexts:
            self._contexts.pop().__exit__(None, None, None)
