"""What a checkpoint records of tensor parallelism, and the checks and cuts a load makes of it.

A tensor-parallel engine saves each slice parameter as one tensor of T slices
(see `zerodp.checkpoint_io.tensors`); `zerodp_state.json` says so under
`"tensor_parallel": {"size": T, "slices": {name: split dim}}`, with each
parameter's local (slice) shape under `params` as usual, and the run's dims under
`dims` (`ParallelDims.to_record`). Such a checkpoint loads into an engine with any
T' (1 included) at any number of data-parallel ranks and any stage: the whole
shapes must agree, and `cuts` says, for each parameter whose cut differs, the saved
cut and this engine's, which `zerodp.checkpoint_io.tensor_relayout` reads across
(see [Note: another tensor-parallel degree] there). `zerodp consolidate` joins the
slices into the whole tensors (`join_slices`).
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.checkpoint_io import integrity
from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.errors import CheckpointError, ConfigError
from zerodp.parallel import ParallelDims
from zerodp.parallel.composition import Feature, refusal_for
from zerodp.parallel.tensor_slices import TensorSlices

KEY = "tensor_parallel"
DIMS = "dims"
_DAMAGED = "the checkpoint's zerodp_state.json is damaged"

Cuts = dict[str, tuple[TensorSlices, TensorSlices]]  # name -> (saved cut, this engine's cut)


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


def saved_dims(shared: dict[str, Any]) -> ParallelDims:
    """The dims a checkpoint was saved with: recorded since tensor-parallel loads at another
    T; before, its world size and T (the other sizes do not decide how slices are cut)."""
    size = saved_size(shared)
    record = shared.get(DIMS)
    try:
        if record is None:
            return ParallelDims.build(shared["world_size"], 0, tensor_size=size)
        dims = ParallelDims.from_record(record)
    except (ValueError, ConfigError) as caught:
        raise CheckpointError(
            f"checkpoint state: '{DIMS}' is damaged ({caught}); {_DAMAGED}"
        ) from None
    if dims.tensor_size != size:
        raise CheckpointError(f"checkpoint state: '{DIMS}' and '{KEY}' disagree; {_DAMAGED}")
    return dims


def cuts(subject: CheckpointSubject, shared: dict[str, Any]) -> Cuts:
    """Check that the checkpoint is of this model (names and whole shapes), and return each
    parameter whose saved cut differs from this engine's, with both cuts; a change that
    cannot be served is a `CheckpointError` naming both layouts and the fix."""
    saved, mine = saved_dims(shared), subject.dims
    saved_split: dict[str, int] = shared[KEY]["slices"] if saved.splits_tensors else {}
    whole_saved = {}
    for name, info in shared["params"].items():
        shape = tuple(info["shape"])
        whole_saved[name] = (
            saved.whole_shape(shape, saved_split[name]) if name in saved_split else shape
        )
    whole_mine = {}
    recorded = subject.recorded_shapes()  # an expert slice's whole shape, as saved
    for name, param in subject.module.named_parameters():
        shape = tuple(param.shape)
        split = subject.tensor_slices.get(name)
        whole_mine[name] = (
            tuple(recorded[name]) if split is None else mine.whole_shape(shape, split)
        )
    integrity.check_model(whole_mine, whole_saved)
    out: Cuts = {}
    for name, whole in whole_mine.items():
        old, new = saved_split.get(name), subject.tensor_slices.get(name)
        if old == new and saved.tensor_size == mine.tensor_size:
            continue  # the same cut (or whole in both)
        dim = new if old is None else old
        if dim is None:
            continue  # whole in both
        if new is not None and new != dim:
            raise CheckpointError(
                f"{_layouts(saved, mine)}: the checkpoint splits '{name}' along dim {old}, this "
                f"engine along dim {new} (another tensor_parallel plan); {_FIX}"
            )
        try:
            out[name] = (
                TensorSlices.whole(whole, dim) if old is None else saved.tensor_slices(whole, dim),
                TensorSlices.whole(whole, dim) if new is None else mine.tensor_slices(whole, dim),
            )
        except ValueError as caught:
            raise CheckpointError(f"{_layouts(saved, mine)}: '{name}': {caught}; {_FIX}") from None
    return out


_FIX = (
    "load it with the saving run's tensor_parallel settings, or write its whole weights "
    "(`zerodp consolidate`) and load those with engine.load_state_dict()"
)


def _layouts(saved: ParallelDims, mine: ParallelDims) -> str:
    return (
        f"the checkpoint was saved with tensor_parallel.autotp_size {saved.tensor_size}, "
        f"this engine has {mine.tensor_size}"
    )


def join_slices(flat: torch.Tensor, local_shape: list[int], dim: int, size: int) -> torch.Tensor:
    """The whole tensor from a saved tensor of `size` slices of `local_shape` (split on `dim`)."""
    slices = flat.view(size, *local_shape).unbind(0)
    return torch.cat(slices, dim=dim)
