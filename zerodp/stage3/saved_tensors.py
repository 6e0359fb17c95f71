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

[Note: saving windows]
The hooks cost a Python call for every tensor a forward saves, and only a
sharded parameter's storage needs one. So they are installed only while a
forward scope that holds sharded groups runs (the module that gathered them,
and everything it calls), not around the whole forward: a block whose
parameters are all persistent, and code between modules, save without them.
This is exact because a saved tensor can share a sharded group's storage
only if some operation read the group, and in a forward every read happens
inside such a scope:

- while a forward pass runs (`ParamCoordinator.begin_forward` to
  `end_forward`), a gathered group has the plain class only while a forward
  scope claims it (`GatherState.claim`), and that scope has the hooks;
- any other read (a group kept gathered for reuse, prefetched for a module
  not yet entered, held by `GatheredParameters`, or a released one) finds the
  guarded `ZeroParameter` class, whose `__torch_function__` makes the
  innermost running scope hold and claim the group, and install the hooks,
  before the operation runs; the scope is remembered as a user of the group,
  so the next forward gathers it up front.

A view of a parameter taken in one scope and kept past its end (in a module
attribute, say) escapes this: reading it later would read a released storage
anyway, which stage 3 does not support.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.backward import autograd_api
from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.group_state import GroupState
from zerodp.stage3.gatherer import GroupGatherer
from zerodp.torch_internals import storage_key


class SavedParameterView:
    """What packing returns for a tensor that shares a sharded group's storage."""

    __slots__ = ("state", "tensor")

    def __init__(self, state: GroupState, tensor: torch.Tensor) -> None:
        self.state = state
        self.tensor = tensor


class SavedTensorGatherer:
    """The pack/unpack pair installed in forward scopes (see the module docstring)."""

    def __init__(self, gatherer: GroupGatherer, lifecycle: BackwardLifecycle) -> None:
        self.gatherer = gatherer
        self.unpack = lifecycle.hook(self._unpack)
        self._contexts: list[torch.autograd.graph.saved_tensors_hooks] = []

    def pack(self, tensor: torch.Tensor) -> Any:
        detached = tensor.detach()
        state = self.gatherer.state_of_storage(storage_key(tensor))
        if state is None:
            return detached
        return SavedParameterView(state, detached)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, SavedParameterView):
            return packed
        self.gatherer.ensure_available(packed.state)
        if torch.is_grad_enabled():
            return packed.tensor.clone()
        return packed.tensor

    def push_if_possible(self) -> bool:
        """Install the hooks for a forward scope, unless saved-tensor hooks are active
        (zerodp's own, installed by an enclosing scope, or another's).

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
