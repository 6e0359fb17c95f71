"""Where a load puts each saved tensor: views of the engine's own buffers, planned first.

Planning changes nothing: state a fresh torch optimizer creates only at its
first step is made as new tensors (`plan_missing_state`) and attached by
`attach_planned_state` once every rank has agreed that every check passed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zerodp.checkpoint_io import tensors
from zerodp.checkpoint_io.sharded import quiet_sharded_tensor_warnings
from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.errors import CheckpointError


def fresh_tensors(saved: dict[str, TensorStorageMetadata], prefix: str) -> dict[str, Any]:
    return {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in saved.items()
        if k.startswith(prefix)
    }


def model_destinations(subject: CheckpointSubject, saved: dict[str, Any]) -> dict[str, Any]:
    """Where the saved values go: fp32 values (masters, when saved) into the fp32 copies."""
    places = subject.places(saving=False)
    model = tensors.model_tensors(subject, places)
    masters = tensors.master_tensors(subject, places)
    destinations: dict[str, Any] = {}
    for key, tensor in model.items():
        if not key.startswith("model."):
            if key in saved:
                destinations[key] = tensor
            continue
        name = key.removeprefix("model.")
        saved_master = f"master.{name}" in saved
        if f"master.{name}" in masters:
            # The engine keeps an fp32 master: fill it with the best fp32 values saved; the
            # model's half-precision copy is refreshed from it afterwards.
            source = f"master.{name}" if saved_master else key
            destinations[source] = masters[f"master.{name}"]
        else:
            destinations[f"master.{name}" if saved_master else key] = tensor
    return destinations


PlannedState = dict[nn.Parameter, dict[str, torch.Tensor]]  # by the optimizer's parameter


def optimizer_destinations(
    subject: CheckpointSubject, saved: dict[str, Any], planned: PlannedState
) -> dict[str, Any]:
    """The optimizer state's destinations, including state `planned` for a fresh optimizer."""
    elsewhere = _held_elsewhere(subject)
    saved_optim = {
        k for k in saved if k.startswith("optim.") and _state_owner_name(k) not in elsewhere
    }
    if not saved_optim:
        return {}
    wanted = tensors.optimizer_tensors(subject, subject.places(saving=False), planned)
    missing = sorted(set(wanted) - saved_optim)
    unexpected = sorted(saved_optim - set(wanted))
    if missing or unexpected:
        raise CheckpointError(
            "the checkpoint's optimizer state does not match this optimizer (was it saved "
            f"with a different optimizer class?): missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; pass load_optimizer_states=False to load the weights only"
        )
    return wanted


def _state_owner_name(key: str) -> str:
    """The parameter name in `optim.<name>.<key>` (torch's state keys have no dots)."""
    return key.removeprefix("optim.").rsplit(".", 1)[0]


def _held_elsewhere(subject: CheckpointSubject) -> set[str]:
    """Parameters stepped whole by other ranks: their state is not this rank's to load."""
    whole = subject.whole_tensors
    return set() if whole is None else whole.names - set(whole.owned_params())


def plan_missing_state(subject: CheckpointSubject, saved: dict[str, Any]) -> PlannedState:
    """The state a fresh torch optimizer creates only at its first step, shaped as saved.

    Only planned here (new tensors, nothing attached to the optimizer): the
    load attaches them once every rank has agreed that every check passed.
    """
    existing = subject.optimizer.state
    planned: PlannedState = {}
    whole = subject.whole_tensors
    if whole is not None:
        for name, param in whole.owned_params().items():
            if existing.get(param):
                continue
            slots = {
                _slot(key, name): torch.zeros(
                    meta.size, dtype=meta.properties.dtype, device=param.device
                )
                if len(meta.size)
                else torch.zeros((), dtype=meta.properties.dtype)
                for key, meta in saved.items()
                if key.startswith(f"optim.{name}.") and _state_owner_name(key) == name
            }
            if slots:
                planned[param] = slots
    for entry in tensors.param_entries(subject):
        state = entry.state
        if state is None or state.optim is None or existing.get(state.optim.param):
            continue
        if whole is not None and entry.name in whole.names:
            continue
        owned = state.optim.param
        slots = planned.setdefault(owned, {})
        prefix = f"optim.{entry.name}."
        for key, meta in saved.items():
            slot = key.removeprefix(prefix)
            if not key.startswith(prefix) or slot in slots:
                continue
            dtype = meta.properties.dtype
            if len(meta.size) == 0:
                slots[slot] = torch.zeros((), dtype=dtype)
            else:
                slots[slot] = torch.zeros_like(owned, dtype=dtype)
    return {param: slots for param, slots in planned.items() if slots}


def _slot(key: str, name: str) -> str:
    return key.removeprefix(f"optim.{name}.")


def attach_planned_state(subject: CheckpointSubject, planned: PlannedState) -> None:
    for param, slots in planned.items():
        subject.optimizer.state[param] = slots


def check_kinds(destinations: dict[str, Any], saved: dict[str, Any], metadata: Any) -> None:
    """Every key to be read is a tensor of the shape the load expects.

    DCP would read a key its metadata calls bytes with `torch.load(weights_only=False)`,
    which runs code; and a wrong global shape fails inside its collectives. Both are
    refused here, before DCP is called.
    """
    entries = metadata.state_dict_metadata
    for key, destination in destinations.items():
        entry = entries.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint key '{key}' is not a tensor in the DCP metadata; the checkpoint "
                "is damaged or was not written by zerodp"
            )
        size = getattr(destination, "size", None)
        with quiet_sharded_tensor_warnings():
            shape = tuple(size()) if callable(size) else None
        if shape is not None and shape != tuple(entry.size):
            raise CheckpointError(
                f"checkpoint key '{key}' has shape {tuple(entry.size)}, this engine expects "
                f"{shape}; the checkpoint is for a different model"
            )


def check_rng(saved: dict[str, Any], saved_world_size: int) -> None:
    """Every saving rank's torch generator state is there, in the format torch uses."""
    reference = torch.get_rng_state()
    for rank in range(saved_world_size):
        entry = saved.get(f"rng.rank{rank}.cpu")
        if entry is None:
            raise CheckpointError(
                f"the checkpoint has no random generator state for rank {rank}; it is incomplete"
            )
        if entry.properties.dtype != reference.dtype or tuple(entry.size) != tuple(reference.shape):
            raise CheckpointError(
                f"the checkpoint's generator state of rank {rank} is not a torch CPU generator "
                f"state ({entry.properties.dtype}, {tuple(entry.size)}); it is damaged"
            )
