"""What a checkpoint records of tensor parallelism, and the checks that use it.

A tensor-parallel engine saves each slice parameter as one tensor of T slices
(see `zerodp.checkpoint_io.tensors`); `zerodp_state.json` says so under
`"tensor_parallel": {"size": T, "slices": {name: split dim}}`, with each
parameter's local (slice) shape under `params` as usual. Such a checkpoint
loads into an engine with the same T at any number of data-parallel ranks and
any stage (DCP reshards each slice over the new shard groups); another T is
refused before anything changes. `zerodp consolidate` joins the slices into the
whole tensors (`join_slices`).
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.errors import CheckpointError
from zerodp.parallel.composition import Feature, refusal_for

KEY = "tensor_parallel"
_DAMAGED = "the checkpoint's zerodp_state.json is damaged"


def describe(subject: CheckpointSubject) -> dict[str, Any] | None:
    """The `tensor_parallel` entry of zerodp_state.json (None without tensor parallelism)."""
    if subject.tensor_size == 1:
        return None
    return {"size": subject.tensor_size, "slices": dict(subject.tensor_slices)}


def check_can_save(subject: CheckpointSubject) -> None:
    """A save inside an accumulation window, where the composition table refuses it."""
    refused = refusal_for(Feature.WINDOW_CHECKPOINT, subject.dims)
    if refused is not None and subject.gradients_held():
        raise CheckpointError(refused)


def saved_size(shared: dict[str, Any]) -> int:
    """The T a checkpoint was saved with (1: none), its entry checked."""
    entry = shared.get(KEY)
    if entry is None:
        return 1
    size = entry.get("size") if isinstance(entry, dict) else None
    slices = entry.get("slices") if isinstance(entry, dict) else None
    if (
        not isinstance(size, int)
        or isinstance(size, bool)
        or size < 2
        or not isinstance(slices, dict)
        or not all(isinstance(d, int) and d in (0, 1) for d in slices.values())
    ):
        raise CheckpointError(f"checkpoint state: '{KEY}' is malformed; {_DAMAGED}")
    return size


def check_matches(subject: CheckpointSubject, shared: dict[str, Any]) -> None:
    """The checkpoint was saved with this engine's T (another T is refused)."""
    saved, mine = saved_size(shared), subject.tensor_size
    if saved == mine:
        return
    raise CheckpointError(
        f"the checkpoint was saved with tensor_parallel.autotp_size {saved}, this engine has "
        f"{mine}: load it with autotp_size {saved} (at any number of data-parallel ranks), or "
        "write its whole weights (`zerodp consolidate`, or save_16bit_model() when saving) and "
        "load those with engine.load_state_dict()"
    )


def join_slices(flat: torch.Tensor, local_shape: list[int], dim: int, size: int) -> torch.Tensor:
    """The whole tensor from a saved tensor of `size` slices of `local_shape` (split on `dim`)."""
    slices = flat.view(size, *local_shape).unbind(0)
    return torch.cat(slices, dim=dim)
