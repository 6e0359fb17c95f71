"""The tensors of a checkpoint, keyed by parameter name, independent of stage and world size.

Every tensor is saved as the flattened (1-D) tensor of one parameter, under
`model.<name>` (the model's values), `master.<name>` (fp32 master weights,
mixed precision only) and `optim.<name>.<key>` (optimizer state: per-element
state such as `exp_avg` 1-D, scalar state such as `step` 0-d). Each rank
contributes the part it holds: a part of a flat group's shard is a 1-D chunk
`[start, start + length)` of a parameter, described to DCP as a shard of a
ShardedTensor built from metadata every rank computes alike (no collective).
Replicated values (stage 0, resident parameters, buffers) are plain tensors,
which DCP writes once. DCP reshards on load: any stage and world size can
load any other's checkpoint, since the keys and global shapes never change.

The same plan gives the destinations for loading: views into the engine's
own buffers, so DCP writes the loaded values in place.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from zerodp.partition import FlatGroup

if TYPE_CHECKING:
    from zerodp.engine import ZeroEngine


@contextlib.contextmanager
def quiet_sharded_tensor_warnings() -> Iterator[None]:
    """ShardedTensor is deprecated in favour of DTensor, which cannot describe the uneven
    1-D chunks flat-group shards make of a parameter; DCP still reads and writes it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*ShardedTensor.*")
        yield


with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )


@dataclass(frozen=True)
class Piece:
    rank: int
    start: int  # offset in the flattened parameter
    length: int


def pieces_of(group: FlatGroup, position: int) -> list[Piece]:
    """Which rank holds which part of parameter `position` of `group`'s shards."""
    found = []
    for rank in range(group.layout.world_size):
        overlap = group.layout.overlap(position, rank)
        if overlap is not None:
            found.append(Piece(rank, overlap.param_start, overlap.numel))
    return found


def sharded_1d(
    local: torch.Tensor | None, numel: int, pieces: list[Piece], dtype: torch.dtype
) -> ShardedTensor:
    """A 1-D ShardedTensor of `numel` elements whose rank-r chunk is `pieces[r]`."""
    rank = dist.get_rank()
    device = local.device if local is not None else torch.device("cpu")
    shards_metadata = [
        ShardMetadata(
            shard_offsets=[piece.start],
            shard_sizes=[piece.length],
            placement=f"rank:{piece.rank}/{_device_text(device, piece.rank)}",
        )
        for piece in pieces
    ]
    local_shards = []
    for piece, metadata in zip(pieces, shards_metadata, strict=True):
        if piece.rank == rank:
            if local is None or local.numel() != piece.length:
                raise RuntimeError("internal error: local chunk does not match the layout")
            local_shards.append(Shard(tensor=local, metadata=metadata))
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False)
    global_metadata = ShardedTensorMetadata(
        shards_metadata=shards_metadata,
        size=torch.Size([numel]),
        tensor_properties=properties,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, global_metadata
        )


def _device_text(device: torch.device, rank: int) -> str:
    if device.type == "cpu":
        return "cpu"
    count = max(1, getattr(torch, device.type).device_count())
    return f"{device.type}:{rank % count}"


@dataclass
class ParamEntry:
    name: str
    param: nn.Parameter
    group: FlatGroup | None  # None: not managed (frozen at stages 0-2)
    position: int


def param_entries(engine: ZeroEngine) -> Iterator[ParamEntry]:
    for name, param in engine.module.named_parameters():
        group = engine.layout.group_of(param)
        position = -1
        if group is not None:
            position = next(i for i, p in enumerate(group.params) if p is param)
        yield ParamEntry(name, param, group, position)


def owned_chunk(
    owned: torch.Tensor, group: FlatGroup, position: int, owns_full: bool
) -> torch.Tensor | None:
    """This rank's part of a parameter inside an owned-range tensor (a shard, or the group)."""
    if owns_full:
        start, end = group.slot_of(position)
        return owned[start:end]
    overlap = group.layout.overlap(position, group.rank)
    if overlap is None:
        return None
    return owned[overlap.shard_start : overlap.shard_end]


def as_entry(
    owned: torch.Tensor, group: FlatGroup, position: int, replicated: bool
) -> torch.Tensor | ShardedTensor:
    """The checkpoint tensor for one parameter's part of an owned-range tensor."""
    if replicated:
        start, end = group.slot_of(position)
        return owned[start:end]
    slot = group.layout.slots[position]
    return sharded_1d(
        owned_chunk(owned, group, position, owns_full=False),
        slot.numel,
        pieces_of(group, position),
        owned.dtype,
    )


def model_tensors(engine: ZeroEngine) -> dict[str, Any]:
    """`model.<name>` for every parameter, `buffer.<name>` for every buffer."""
    out: dict[str, Any] = {}
    for entry in param_entries(engine):
        group = entry.group
        if group is None:
            out[f"model.{entry.name}"] = entry.param.data.view(-1)
        elif group.separate_shard:  # stage 3: only the shard exists
            slot = group.layout.slots[entry.position]
            chunk = owned_chunk(group.shard, group, entry.position, owns_full=False)
            out[f"model.{entry.name}"] = sharded_1d(
                chunk, slot.numel, pieces_of(group, entry.position), group.dtype
            )
        else:
            start, end = group.slot_of(entry.position)
            out[f"model.{entry.name}"] = group.full[start:end]
    for name, buffer in engine.module.named_buffers():
        out[f"buffer.{name}"] = buffer
    return out


def master_tensors(engine: ZeroEngine) -> dict[str, Any]:
    """`master.<name>`: the fp32 masters (mixed precision), sharded like the optimizer state."""
    masters = engine.masters
    if masters is None:
        return {}
    owns_full = engine.strategy.reduction.optimizer_owns_full_group
    out: dict[str, Any] = {}
    for entry in param_entries(engine):
        if entry.group is None:
            continue
        master = masters.master_of(entry.group)
        if master is not None:
            out[f"master.{entry.name}"] = as_entry(master, entry.group, entry.position, owns_full)
    return out


def optimizer_tensors(engine: ZeroEngine) -> dict[str, Any]:
    """`optim.<name>.<key>`: per-element state sharded like the masters; scalar state replicated."""
    owns_full = engine.strategy.reduction.optimizer_owns_full_group
    shard_params = engine.full_state.shard_params
    state = engine.optimizer.state
    out: dict[str, Any] = {}
    for entry in param_entries(engine):
        if entry.group is None or id(entry.group) not in shard_params:
            continue
        shard = shard_params[id(entry.group)]
        for key, value in state.get(shard, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            fqn = f"optim.{entry.name}.{key}"
            if value.numel() == shard.numel() and value.dim() == 1:
                out[fqn] = as_entry(value, entry.group, entry.position, owns_full)
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
