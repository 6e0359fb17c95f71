"""A checkpoint's tensor-parallel slices loaded at another T: read the saved rows, assemble.

[Note: another tensor-parallel degree]
A slice is saved as part t of one 1-D tensor of T parts (`zerodp.checkpoint_io.tensors`),
and a load under another T' describes its own slice as part t' of T' parts of the same
key. For a weight split along its first non-trivial dimension (a column-parallel
weight, a split bias or embedding) the parts in order are the whole weight flattened,
whatever T: the key holds the same 1-D tensor and DCP reads across unaided. Split along
a later dimension (a row-parallel weight, cut along its input features) the parts sit
side by side in every row, and the 1-D tensors differ: for each piece of its slice a
rank holds (its shard of it, or all of it), it asks the cuts which rows of which saved
parts make it up (`TensorSlices.cover`, the saved cut from the saved dims, this engine's
from its own), has DCP read just those rows into host buffers, and cuts its piece out of
them. The same holds for values saved per rank (a window's local sums, each of one saved
part): the pieces are read from every rank that holds a part and combined as the saved
dims say (`ParallelDims.window_sum_sources`). A rank reads the rows its pieces span, of
the saved parts its slice overlaps: what it holds, or up to T'/T times that where a saved
part is wider than its slice (T' > T), plus the rest of a row a shard starts or ends in.
The reads go in rounds of at most `ROUND_BYTES` of saved values, so the host buffers
stay bounded whatever the model's size. Every rank runs the same rounds (they
follow the parameters' order and the saved sizes), so DCP's collectives match.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zerodp.checkpoint_io.agreed import root_cause
from zerodp.checkpoint_io.integrity import CHECKPOINT_FAILURES
from zerodp.checkpoint_io.sharded import ShardedTensor, quiet_sharded_tensor_warnings, reading_1d
from zerodp.checkpoint_io.tensor_slices import Cuts
from zerodp.comm import Comm
from zerodp.errors import CheckpointError
from zerodp.parallel.tensor_slices import Cover, TensorSlices

ROUND_BYTES = 1 << 28  # saved values read per round (at least one parameter's)

# The keys a parameter's values are saved under (see `zerodp.checkpoint_io.tensors` and
# `zerodp.checkpoint_io.window_gradients`): its name follows the prefix, and an optimizer
# state's slot (torch's keys have no dots) ends it.
_OWNED_KEY = re.compile(r"^(?:model|master|grad|grad_local\.rank\d+|grad_replica\d+)\.(.+)$")


def owner_of(key: str) -> str | None:
    """The parameter name a checkpoint key holds values of (None: not a parameter's)."""
    if key.startswith("optim."):
        return key.removeprefix("optim.").rsplit(".", 1)[0]
    found = _OWNED_KEY.match(key)
    return None if found is None else found.group(1)


@dataclass(frozen=True)
class SavedParts:
    """Where one parameter's saved parts are: part p is the sum of the values of `keys[p]`
    from `offsets[p]` on, divided by `divisor` (a value saved once: one key, the part's
    offset in it, 1; a window's local sums: the saved ranks' keys, each at 0, D)."""

    cut: TensorSlices
    keys: tuple[tuple[str, ...], ...]
    offsets: tuple[int, ...]
    divisor: int = 1

    @classmethod
    def one_tensor(cls, cut: TensorSlices, key: str) -> SavedParts:
        parts = range(cut.count)
        return cls(cut, tuple((key,) for _ in parts), tuple(cut.offset(p) for p in parts))


@dataclass(frozen=True)
class _Piece:
    """Values of this engine's slice, read from `parts` as `cover` says, into `out`."""

    parts: SavedParts
    cover: Cover
    out: torch.Tensor

    def reads(self) -> Iterator[tuple[str, int, int]]:
        for read in self.cover.reads:
            offset = self.parts.offsets[read.part]
            for key in self.parts.keys[read.part]:
                yield key, offset + read.start, offset + read.stop

    def assemble(self, fetch: Callable[[str, int, int], torch.Tensor]) -> None:
        blocks = []
        for read in self.cover.reads:
            offset = self.parts.offsets[read.part]
            keys = self.parts.keys[read.part]
            values = [fetch(key, offset + read.start, offset + read.stop) for key in keys]
            if len(values) == 1 and self.parts.divisor == 1:
                rows = values[0]
            else:  # as the boundary's reduction: summed in fp32, then divided
                rows = torch.stack([v.float() for v in values]).sum(0).div_(self.parts.divisor)
            rows = rows.view(self.cover.rows, -1, self.cover.inner)
            blocks.append(rows[:, read.keep_start : read.keep_stop])
        joined = torch.cat(blocks, dim=1).reshape(-1)
        start = self.cover.offset
        self.out.copy_(joined[start : start + self.cover.length])


@dataclass
class Relayout:
    """What a load reads across cuts: the parameters of `cuts` (name -> saved cut, this
    engine's; only those that differ), planned piece by piece before anything changes."""

    cuts: Cuts
    saved: dict[str, TensorStorageMetadata]
    _pieces: dict[str, list[_Piece]] = field(default_factory=dict)

    def need(self, name: str) -> None:
        """`name` is read in the rounds, whether or not this rank holds a piece of it: every
        rank marks the same names (from the cuts and the saved keys), so the rounds agree."""
        self._pieces.setdefault(name, [])

    def add(self, name: str, parts: SavedParts, part: int, start: int, out: torch.Tensor) -> None:
        """Plan values [start, start + out.numel()) of part `part` of `name`'s cut in this
        engine, read from `parts`, into the 1-D tensor `out` (filled by `read`)."""
        self.need(name)
        if out.numel() == 0:
            return
        for keys in parts.keys:
            for key in keys:
                entry = self.saved.get(key)
                if not isinstance(entry, TensorStorageMetadata) or len(entry.size) != 1:
                    raise CheckpointError(
                        f"checkpoint key '{key}' is not the 1-D tensor of a parameter's values; "
                        "the checkpoint is damaged or was not written by zerodp"
                    )
        cover = parts.cut.cover(self.cuts[name][1], part, start, out.numel())
        self._pieces.setdefault(name, []).append(_Piece(parts, cover, out))

    def take_from(self, wanted: dict[str, Any]) -> None:
        """Move every destination in `wanted` whose saved 1-D tensor is ordered otherwise
        (see the Note) into this plan: the rest DCP reads across itself."""
        for name, (saved_cut, cut) in self.cuts.items():
            if saved_cut.flat_order() != cut.flat_order():
                self.need(name)  # on every rank, whatever it holds (the rounds agree)
        for key in list(wanted):
            key_name = owner_of(key)
            cuts = None if key_name is None else self.cuts.get(key_name)
            if key_name is None or cuts is None or cuts[0].flat_order() == cuts[1].flat_order():
                continue
            entry = self.saved.get(key)
            if not isinstance(entry, TensorStorageMetadata) or len(entry.size) != 1:
                continue  # a scalar state (a step count): the same whatever the cut
            saved_cut, cut = cuts
            numel = saved_cut.offset(saved_cut.count)
            if entry.size[0] != numel:
                raise CheckpointError(
                    f"checkpoint key '{key}' has {entry.size[0]} values, the tensor-parallel "
                    f"slices of '{key_name}' make {numel}; the checkpoint is damaged"
                )
            parts = SavedParts.one_tensor(saved_cut, key)
            for offset, out in _local_pieces(wanted.pop(key)):
                part, start = cut.locate(offset)
                self.add(key_name, parts, part, start, out)

    def rounds(self) -> list[list[str]]:
        """The parameters read together, in the model's order: at most `ROUND_BYTES` of saved
        values each (at least one parameter). The same on every rank (see `need`)."""
        found: list[list[str]] = []
        used = ROUND_BYTES
        sizes = _saved_bytes(self.saved, set(self._pieces))
        for name in (n for n in self.cuts if n in self._pieces):
            if used + sizes.get(name, 0) > ROUND_BYTES:
                found.append([])
                used = 0
            found[-1].append(name)
            used += sizes.get(name, 0)
        return found

    def read(self, comm: Comm, reader: Callable[[], Any], where: str) -> None:
        """Read every round (one DCP load each, on every rank) and assemble its pieces."""
        for names in self.rounds():
            pieces = [piece for name in names for piece in self._pieces.get(name, [])]
            buffers = _Buffers(self.saved)
            for piece in pieces:
                for key, start, stop in piece.reads():
                    buffers.ask(key, start, stop)
            error: BaseException | None = None
            try:
                with quiet_sharded_tensor_warnings():
                    state = buffers.state_dict()
                    dcp.load(state, storage_reader=reader(), process_group=comm.group)
                for piece in pieces:
                    piece.assemble(buffers.fetch)
            except CHECKPOINT_FAILURES as caught:
                error = CheckpointError(f"reading {where} failed: {root_cause(caught)}")
            comm.raise_if_any_failed(error)


class _Buffers:
    """The host buffers of one round: each key's asked ranges, merged where they touch."""

    def __init__(self, saved: dict[str, TensorStorageMetadata]) -> None:
        self.saved = saved
        self.asked: dict[str, list[tuple[int, int]]] = {}
        self.held: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def ask(self, key: str, start: int, stop: int) -> None:
        self.asked.setdefault(key, []).append((start, stop))

    def state_dict(self) -> dict[str, ShardedTensor]:
        state = {}
        for key, ranges in self.asked.items():
            merged: list[list[int]] = []
            for start, stop in sorted(ranges):
                if merged and start <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], stop)
                else:
                    merged.append([start, stop])
            entry = self.saved[key]
            dtype = entry.properties.dtype
            held = [(start, torch.empty(stop - start, dtype=dtype)) for start, stop in merged]
            self.held[key] = held
            state[key] = reading_1d(entry.size[0], held, dtype)
        return state

    def fetch(self, key: str, start: int, stop: int) -> torch.Tensor:
        for at, buffer in self.held[key]:
            if at <= start and stop <= at + buffer.numel():
                return buffer[start - at : stop - at]
        raise RuntimeError(f"internal error: {key} [{start}, {stop}) was not read")


def _local_pieces(destination: Any) -> list[tuple[int, torch.Tensor]]:
    """(offset in the 1-D tensor of every part, this rank's values there) of a destination."""
    if isinstance(destination, ShardedTensor):
        return [
            (shard.metadata.shard_offsets[0], shard.tensor) for shard in destination.local_shards()
        ]
    return [(0, destination.view(-1))]


def _saved_bytes(saved: dict[str, TensorStorageMetadata], names: set[str]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for key, entry in saved.items():
        name = owner_of(key)
        if name in names and isinstance(entry, TensorStorageMetadata):
            numel = 1
            for n in entry.size:
                numel *= n
            element = torch.empty((), dtype=entry.properties.dtype).element_size()
            sizes[name] = sizes.get(name, 0) + numel * element
    return sizes
