"""The one wrapper around ShardedTensor's internals, which checkpoints need and torch hides.

ShardedTensor is deprecated in favour of DTensor, which cannot describe the
uneven 1-D chunks flat-group shards make of a parameter; DCP still reads and
writes it. Building one from local chunks plus metadata that every rank
computes alike (no collective) takes a private constructor; this file is
the only user of it (see also `zerodp.torch_internals`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerodp.checkpoint_io.subject import ShardPlaces
from zerodp.partition import FlatGroup


@contextlib.contextmanager
def quiet_sharded_tensor_warnings() -> Iterator[None]:
    """Silence ShardedTensor's deprecation warning (see the module docstring)."""
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


def pieces_of(
    group: FlatGroup, position: int, places: ShardPlaces, sliced: bool = False
) -> list[Piece]:
    """Which rank holds which part of parameter `position` of `group`'s shards.

    The shards are those of the shard groups `places` names (a save describes the first
    replica's, so each shard is written once; a load the rank's own, so every replica
    reads). A tensor-parallel slice (`sliced`) is part t of a tensor of `num_slices`
    slices: each slice's shards are described, at its offset.
    """
    numel = group.layout.slots[position].numel
    slices = range(places.num_slices) if sliced else [places.whole]
    found = []
    for index, t in enumerate(slices):
        offset = index * numel if sliced else 0
        ranks = places.groups[t]
        for place in range(group.layout.world_size):
            overlap = group.layout.overlap(position, place)
            if overlap is not None:
                found.append(Piece(ranks[place], offset + overlap.param_start, overlap.numel))
    return found


def slice_pieces(numel: int, places: ShardPlaces) -> list[Piece]:
    """A tensor-parallel slice every rank of a shard group holds whole (stage 0, persistent
    groups, parameters no group manages): slice t of `num_slices`, held by the rank at
    `places.place` of group t."""
    return [Piece(ranks[places.place], t * numel, numel) for t, ranks in enumerate(places.groups)]


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
    return _from_local(local_shards, shards_metadata, numel, dtype)


def reading_1d(
    numel: int, local: list[tuple[int, torch.Tensor]], dtype: torch.dtype
) -> ShardedTensor:
    """A 1-D tensor of `numel` values of which this rank reads the ranges `local` (start, 1-D
    buffer on the host; disjoint) into those buffers, whatever ranks wrote them.

    DCP reads only a ShardedTensor's local shards, but its metadata must cover the tensor
    without overlap: the ranges no buffer asks for are described as the next rank's (it
    reads its own description, not this one); a single rank reads them into throwaway
    buffers (it asks for nearly everything anyway: it holds every slice whole).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces: list[tuple[Piece, torch.Tensor | None]] = []

    def gap(start: int, length: int) -> None:
        if world == 1:
            pieces.append((Piece(rank, start, length), torch.empty(length, dtype=dtype)))
        else:
            pieces.append((Piece((rank + 1) % world, start, length), None))

    at = 0
    for start, buffer in sorted(local, key=lambda item: item[0]):
        if start < at:
            raise RuntimeError("internal error: overlapping ranges to read")
        if start > at:
            gap(at, start - at)
        pieces.append((Piece(rank, start, buffer.numel()), buffer))
        at = start + buffer.numel()
    if at < numel:
        gap(at, numel - at)
    shards_metadata = [
        ShardMetadata(
            shard_offsets=[piece.start],
            shard_sizes=[piece.length],
            placement=f"rank:{piece.rank}/cpu",
        )
        for piece, _ in pieces
    ]
    local_shards = [
        Shard(tensor=buffer, metadata=metadata)
        for (_, buffer), metadata in zip(pieces, shards_metadata, strict=True)
        if buffer is not None
    ]
    return _from_local(local_shards, shards_metadata, numel, dtype)


def _from_local(
    local_shards: list[Shard], shards_metadata: list[ShardMetadata], numel: int, dtype: torch.dtype
) -> ShardedTensor:
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
