"""`engine.offload_states()` / `engine.reload_states()`: model states to the host and back.

[Note: state offload]
Between training and rollout a job moves what training holds off the
accelerator, and back before the next step: parameters (`lp_params`), fp32
master weights (`hp_params`), optimizer state (`optim_states`) and kept
gradients (`lp_grads`), with DeepSpeed's names and arguments. Each of these is
one or more storages shared by many tensors: a flat group's parameters, shard
and optimizer parameter are views of one buffer. A storage moves whole: its
bytes are copied into one host buffer, and every tensor zerodp holds on it
(found by storage) is re-pointed (`tensor.data = view`) at the same offset,
size and strides in the host buffer, so every alias stays an alias and no
object changes identity (optimizer state stays keyed by its parameters).
Reloading does the same in the other direction; the round trip is bitwise.

Nothing is freed in place: a tensor zerodp does not know about (saved by a
live autograd graph, held by user code) keeps the old storage alive and valid
rather than dangling. The device memory is returned once nothing refers to it.

While states are on the host the engine refuses what needs them on the device,
naming `reload_states()`: a forward (parameters), a backward (parameters and
gradients), `zero_grad()` (gradients), a step or a checkpoint (everything),
generation and weight streaming (parameters). Stage 3 groups are released
first, and a held group (a `GatheredParameters` block, generation) is an error.
Storages offloaded by the config (`offload_optimizer`, `offload_param`) stay
where they are. `contiguous_grad_buffer` is accepted and moves nothing: the
gradient buckets are let go at the end of every backward.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerodp.errors import UsageError
from zerodp.group_state import GroupIndex, ParamStatus
from zerodp.torch_internals import storage_key


class OffloadStateTypeEnum(str, enum.Enum):
    """What `offload_states(include=...)` moves (DeepSpeed's names)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDeviceEnum(str, enum.Enum):
    """Where `offload_states(device=...)` moves states to (DeepSpeed's names; cpu only)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


Kind = OffloadStateTypeEnum
ALL_KINDS = frozenset(Kind)
# What each guarded call needs on the device (any other call: everything).
_NEEDS: dict[str, frozenset[Kind]] = {
    "a forward": frozenset({Kind.lp_params}),
    "engine.backward()": frozenset({Kind.lp_params, Kind.lp_grads}),
    "engine.scale()": frozenset({Kind.lp_params, Kind.lp_grads}),
    "zero_grad()": frozenset({Kind.lp_grads}),
    "gathered_for_generation()": frozenset({Kind.lp_params}),
    "full_parameters()": frozenset({Kind.lp_params}),
}


@dataclass
class _Moved:
    """One storage on the host: its bytes, and every tensor re-pointed at them."""

    kind: Kind
    host: torch.Tensor  # uint8, the storage's bytes
    device: torch.device
    views: list[torch.Tensor]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage of `tensor`."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def _view_like(base: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s place (offset, size, strides) in `base`'s storage, with `tensor`'s dtype."""
    return torch.empty(0, dtype=tensor.dtype, device=base.device).set_(
        base.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
    )


def parse_include(include: Iterable[Any] | None) -> frozenset[Kind]:
    if include is None:
        return ALL_KINDS
    if isinstance(include, str):
        include = [include]
    kinds = set()
    for item in include:
        try:
            kinds.add(Kind(item))
        except ValueError:
            names = ", ".join(k.value for k in Kind)
            raise UsageError(
                f"offload_states(include=...): unknown state {item!r}; use any of {names}"
            ) from None
    return frozenset(kinds)


class StateOffload:
    """Moves one engine's model states to the host and back (see [Note: state offload])."""

    def __init__(
        self,
        *,
        module: nn.Module,
        groups: GroupIndex,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        release_gathered: Callable[[], None],
        check_outside_backward: Callable[[str], None],
    ) -> None:
        self.module = module
        self.groups = groups
        self.optimizer = optimizer
        self.device = device
        self.release_gathered = release_gathered
        self.check_outside_backward = check_outside_backward
        self._moved: list[_Moved] = []
        self._host_keys: set[int] = set()
        self._forward_guard: Any = None

    @property
    def offloaded(self) -> frozenset[Kind]:
        return frozenset(m.kind for m in self._moved)

    # -- moving ------------------------------------------------------------------------

    @torch.no_grad()
    def offload(
        self,
        include: Container[Any] | None = None,
        device: Any = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        self.check_outside_backward("offload_states()")
        if str(getattr(device, "value", device)) != OffloadDeviceEnum.cpu.value:
            raise UsageError(
                f"offload_states(device={device!r}): states move to the host only; pass "
                "device='cpu' (OffloadDeviceEnum.cpu)"
            )
        kinds = parse_include(include)  # type: ignore[arg-type]
        self.release_gathered()
        held = [s for s in self.groups.sharded if s.status is not ParamStatus.NOT_AVAILABLE]
        if held:
            raise UsageError(
                f"offload_states() while parameters {held[0].sharded_gather.shown_names()} are "
                "gathered (a GatheredParameters block or gathered_for_generation() is open); "
                "leave it first"
            )
        kind_of: dict[int, Kind] = {}  # a storage moves as the first kind that names it
        views_of: dict[int, list[torch.Tensor]] = {}
        for kind, tensor in self._claims():
            key = storage_key(tensor)
            kind_of.setdefault(key, kind)
            views = views_of.setdefault(key, [])
            if all(v is not tensor for v in views):
                views.append(tensor)
        pin = pin_memory and self.device.type != "cpu"
        for key, kind in kind_of.items():
            if kind in kinds:
                self._move_out(kind, views_of[key], pin, non_blocking)
        self._update_forward_guard()
        if self.device.type != "cpu":
            _empty_device_cache()

    def _move_out(
        self, kind: Kind, views: list[torch.Tensor], pin: bool, non_blocking: bool
    ) -> None:
        source = _bytes_of(views[0])
        host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=pin)
        host.copy_(source, non_blocking=non_blocking)
        for view in views:
            view.data = _view_like(host, view)
        self._moved.append(_Moved(kind, host, self.device, views))
        self._host_keys.add(storage_key(host))

    @torch.no_grad()
    def reload(self, non_blocking: bool = False) -> None:
        self.check_outside_backward("reload_states()")
        for moved in self._moved:
            target = torch.empty(moved.host.numel(), dtype=torch.uint8, device=moved.device)
            target.copy_(moved.host, non_blocking=non_blocking)
            for view in moved.views:
                view.data = _view_like(target, view)
        self._moved = []
        self._host_keys = set()
        self._update_forward_guard()

    def remove(self) -> None:
        """At `engine.destroy()`: states come back first, so the module is usable after."""
        if self._moved:
            self.reload()

    # -- what is where -----------------------------------------------------------------

    def on_host(self, tensor: Any) -> bool:
        """Whether `tensor` lives in a buffer `offload_states()` moved (for the accounting)."""
        return isinstance(tensor, torch.Tensor) and storage_key(tensor) in self._host_keys

    def refusal(self, what: str) -> str | None:
        """Why `what` cannot run now (some state it needs is on the host), or None."""
        missing = self.offloaded & _NEEDS.get(what, ALL_KINDS)
        if not missing:
            return None
        shown = ", ".join(sorted(k.value for k in missing))
        return (
            f"{what} while the engine's states are offloaded ({shown} on the host, by "
            "engine.offload_states()); call engine.reload_states() first"
        )

    def check(self, what: str) -> None:
        message = self.refusal(what)
        if message is not None:
            raise UsageError(message)

    def _update_forward_guard(self) -> None:
        wanted = Kind.lp_params in self.offloaded
        if wanted and self._forward_guard is None:
            self._forward_guard = self.module.register_forward_pre_hook(
                lambda module, args: self.check("a forward"), prepend=True
            )
        elif not wanted and self._forward_guard is not None:
            self._forward_guard.remove()
            self._forward_guard = None

    def _claims(self) -> list[tuple[Kind, torch.Tensor]]:
        """Every tensor of model state on the device, with the kind its storage moves as.

        A storage is of the first kind that names it (parameters, then master weights,
        optimizer state, gradients): at fp32 the optimizer parameter is a view of the
        model's own buffer, and moves with `lp_params`.
        """
        by_kind: dict[Kind, list[torch.Tensor]] = {k: [] for k in Kind}
        for state in self.groups:
            flat, optim = state.flat, state.optim
            if state.gather is None:
                by_kind[Kind.lp_params].append(flat.full)
                by_kind[Kind.lp_params] += flat.params
            if not flat.shard_offloaded:
                by_kind[Kind.lp_params].append(flat.shard)
            secondary = None if state.gather is None else state.gather.secondary
            if secondary is not None and secondary.copy is not None:
                by_kind[Kind.lp_params].append(secondary.copy)  # hpZ's copy moves with them
            if optim is not None and not optim.offloaded:
                if optim.copy is not None:
                    by_kind[Kind.hp_params].append(optim.copy)
                by_kind[Kind.hp_params].append(optim.param)
                slots = self.optimizer.state.get(optim.param, {})
                by_kind[Kind.optim_states] += [v for v in slots.values() if torch.is_tensor(v)]
            if state.grads is not None:
                by_kind[Kind.lp_grads].append(state.grads.storage)
        for param in self.module.parameters():
            if not self.groups.manages(param):
                by_kind[Kind.lp_params].append(param)
            if param.grad is not None:
                by_kind[Kind.lp_grads].append(param.grad)
        order = (Kind.lp_params, Kind.hp_params, Kind.optim_states, Kind.lp_grads)
        return [
            (kind, tensor)
            for kind in order
            for tensor in by_kind[kind]
            if tensor.device == self.device
            and tensor.untyped_storage().nbytes() > 0
            and storage_key(tensor) not in self._host_keys  # moved already (a CPU engine)
        ]


def _empty_device_cache() -> None:
    """Give the freed blocks back to the device (the caching allocator keeps them otherwise)."""
    accelerator: Any = getattr(torch, "accelerator", None)
    empty_cache = getattr(accelerator, "empty_cache", None)
    if empty_cache is not None:
        empty_cache()
