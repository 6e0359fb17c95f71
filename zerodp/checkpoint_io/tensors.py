"""The tensors of a checkpoint, keyed by parameter name, independent of stage and world size.

Every tensor is saved as the flattened (1-D) tensor of one parameter, under
`model.<name>` (the model's values), `master.<name>` (the optimizer copy, fp32
master weights under mixed precision) and `optim.<name>.<key>` (optimizer
state: per-element state such as `exp_avg` 1-D, scalar state such as `step`
0-d). Each rank contributes the part it holds: a part of a flat group's
shard is a 1-D chunk `[start, start + length)` of a parameter, described to
DCP as a shard of a ShardedTensor (`zerodp.checkpoint_io.sharded`). Replicated
values (stage 0, persistent groups, buffers) are plain tensors, which DCP
writes once. With shard groups that replicate each other, the first shard
group writes the shards (once, not once per replica) and every rank reads its
own: `ShardPlaces` says whose shards a ShardedTensor describes. With tensor
parallelism a parameter that is a slice is saved as one tensor of T slices
(slice t at offset t x its size: the keys and sizes stay those of one layout
per T), a parameter left whole as above, from tensor rank 0's groups. The state of a
parameter an optimizer steps whole (Muon's momentum, Adafactor's row and
column moments; see `zerodp.optim.tensorwise`) is saved in its own shape by
the rank that holds it (every rank at stage 0, written once). DCP reshards on
load: any stage, world size and shard group size can load any other's
checkpoint, since the keys and global shapes never change; a parameter's
whole-tensor state goes to whichever rank steps it in the loading engine. At another
tensor-parallel degree the slices are read across cuts ([Note: another tensor-parallel
degree] in `zerodp.checkpoint_io.tensor_relayout`).

The same plan gives the destinations for loading: views into the engine's
own buffers, so DCP writes the loaded values in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerodp.checkpoint_io.sharded import ShardedTensor, pieces_of, sharded_1d, slice_pieces
from zerodp.checkpoint_io.subject import CheckpointSubject, ShardPlaces
from zerodp.group_state import GroupState
from zerodp.partition import FlatGroup, Slicing


@dataclass
class ParamEntry:
    name: str
    param: nn.Parameter
    state: GroupState | None  # None: not managed (frozen at stages 0-2)
    position: int
    slicing: Slicing = Slicing.WHOLE  # a tensor- or expert-parallel slice

    @property
    def sliced(self) -> bool:
        return self.slicing is not Slicing.WHOLE


def param_entries(subject: CheckpointSubject) -> Iterator[ParamEntry]:
    for name, param in subject.module.named_parameters():
        slicing = subject.slicing_of(name)
        found = subject.groups.lookup(param)
        if found is None:
            yield ParamEntry(name, param, None, -1, slicing)
        else:
            yield ParamEntry(name, param, found[0], found[1], slicing)


def whole_entry(
    value: torch.Tensor, places: ShardPlaces, slicing: Slicing
) -> torch.Tensor | ShardedTensor:
    """A value every rank of a shard group holds whole: a plain (replicated) tensor, or a
    tensor- or expert-parallel slice of a tensor of T (or E) slices."""
    if slicing is Slicing.WHOLE:
        return value
    places = places.of(slicing)
    pieces = slice_pieces(value.numel(), places)
    return sharded_1d(value, value.numel() * places.num_slices, pieces, value.dtype)


def owned_chunk(owned: torch.Tensor, state: GroupState, position: int) -> torch.Tensor | None:
    """This rank's part of a parameter inside a tensor covering the owned range."""
    flat = state.flat
    if flat.owns_full:
        start, end = flat.slot_of(position)
        return owned[start:end]
    overlap = flat.layout.overlap(position, flat.rank)
    if overlap is None:
        return None
    return owned[overlap.shard_start : overlap.shard_end]


def as_entry(
    owned: torch.Tensor, state: GroupState, position: int, places: ShardPlaces
) -> torch.Tensor | ShardedTensor:
    """The checkpoint tensor for one parameter's part of a tensor covering the owned range
    (the shards of the shard groups `places` names)."""
    flat = state.flat
    if flat.owns_full:  # every rank owns the whole group: a replicated value
        start, end = flat.slot_of(position)
        return whole_entry(owned[start:end], places, flat.slicing)
    return _sharded(owned_chunk(owned, state, position), flat, position, places, owned.dtype)


def _sharded(
    chunk: torch.Tensor | None,
    flat: FlatGroup,
    position: int,
    places: ShardPlaces,
    dtype: torch.dtype,
) -> ShardedTensor:
    """One parameter's shards of `flat` as a checkpoint tensor: of the whole parameter, or of
    a tensor of T (or E) slices when the group holds slices."""
    sliced = flat.slicing is not Slicing.WHOLE
    places = places.of(flat.slicing)
    numel = flat.layout.slots[position].numel
    return sharded_1d(
        chunk,
        numel * (places.num_slices if sliced else 1),
        pieces_of(flat, position, places, sliced),
        dtype,
    )


def model_tensors(subject: CheckpointSubject, places: ShardPlaces) -> dict[str, Any]:
    """`model.<name>` for every parameter, `buffer.<name>` for every buffer."""
    out: dict[str, Any] = {}
    for entry in param_entries(subject):
        state = entry.state
        if state is None:
            out[f"model.{entry.name}"] = whole_entry(
                entry.param.data.view(-1), places, entry.slicing
            )
        elif not state.persistent:  # stage 3: only the shard exists
            flat = state.flat
            overlap = flat.layout.overlap(entry.position, flat.rank)
            chunk = None if overlap is None else flat.shard[overlap.shard_start : overlap.shard_end]
            out[f"model.{entry.name}"] = _sharded(chunk, flat, entry.position, places, flat.dtype)
        else:
            start, end = state.flat.slot_of(entry.position)
            out[f"model.{entry.name}"] = whole_entry(
                state.flat.full[start:end], places, state.flat.slicing
            )
    for name, buffer in subject.module.named_buffers():
        out[f"buffer.{name}"] = buffer
    return out


def master_tensors(subject: CheckpointSubject, places: ShardPlaces) -> dict[str, Any]:
    """`master.<name>`: the optimizer copies (fp32 masters), sharded like the optimizer state."""
    out: dict[str, Any] = {}
    for entry in param_entries(subject):
        state = entry.state
        if state is None or state.optim is None or state.optim.copy is None:
            continue
        out[f"master.{entry.name}"] = as_entry(state.optim.copy, state, entry.position, places)
    return out


def optimizer_tensors(
    subject: CheckpointSubject,
    places: ShardPlaces,
    planned: dict[nn.Parameter, dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """`optim.<name>.<key>`: per-element state sharded like the masters; scalar state replicated;
    the state of a parameter stepped whole, whole, from the rank that holds it.

    `planned` stands in for the state of optimizer parameters that have none yet.
    """
    optimizer_state = subject.optimizer.state
    whole = subject.whole_tensors
    out: dict[str, Any] = {}
    if whole is not None:
        for name, param in whole.owned_params().items():
            slots = (planned or {}).get(param) or optimizer_state.get(param, {})
            for key, value in slots.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{name}.{key}"] = value
    for entry in param_entries(subject):
        state = entry.state
        if (
            state is None
            or state.optim is None
            or (whole is not None and entry.name in whole.names)
        ):
            continue
        owned = state.optim.param
        slots = (planned or {}).get(owned) or optimizer_state.get(owned, {})
        for key, value in slots.items():
            if not isinstance(value, torch.Tensor):
                continue
            fqn = f"optim.{entry.name}.{key}"
            if value.numel() == owned.numel() and value.dim() == 1:
                out[fqn] = as_entry(value, state, entry.position, places)
            else:
                out[fqn] = value
    return out


def rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    out = {f"rng.rank{rank}.cpu": torch.get_rng_state()}
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None and current.type == "cuda":
            out[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(values: dict[str, torch.Tensor], rank: int) -> None:
    cpu = values.get(f"rng.rank{rank}.cpu")
    if cpu is not None:
        torch.set_rng_state(cpu)
    cuda = values.get(f"rng.rank{rank}.cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
