"""`engine.full_parameters()`: the model's full tensors, streamed out in bounded buckets.

[Note: weight streaming]
A generation server (vLLM, SGLang, another process) needs the full weights
after each update. Gathering the whole model on each rank would defeat stage
3, and gathering group by group is bounded by the largest group, not by what
the caller can afford. Here tensors are packed into buckets of at most
`bucket_bytes` (a tensor larger than that is a bucket of its own), and a
bucket is assembled from the shards directly: for each run of consecutive
parameters of one sharded group, each rank that holds part of the run
broadcasts that part into one receive buffer. Nothing else is gathered: no
group's gather state changes, and no group's full buffer is allocated. The
bucket's tensors are views of its receive buffers (or casts of them), so
memory is freed when the caller drops them; a caller that sends each bucket on
before asking for the next holds one bucket at a time.

Names are the module's `state_dict()` names (parameters and persistent
buffers; a tied tensor once, under its first name); values equal
`engine.state_dict()`'s. At stages 0-2 every tensor is whole on every rank and
is copied locally. With tensor parallelism each slice is then gathered whole
over its tensor group (a bucket's slices become T times their size), so every
tensor comes out whole, as the model without tensor parallelism has it.
Iterating is a collective: every rank iterates to the end.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zerodp.comm import Comm, Handle
from zerodp.errors import UsageError
from zerodp.group_state import GroupIndex, GroupState
from zerodp.partition.slicing import SliceRecord, whole_value
from zerodp.posttrain.holding import held, sharded_groups_of
from zerodp.posttrain.peft_merge import LoraMerge, MergedNames
from zerodp.stage3.gatherer import GroupGatherer
from zerodp.torch_internals import PlainTensorOps

DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class _Entry:
    name: str
    tensor: torch.Tensor  # the model's parameter or buffer
    state: GroupState | None  # its sharded group; None: whole on every rank
    position: int
    merge: LoraMerge | None
    numel: int


@dataclass
class StreamReport:
    """Filled in while the stream runs: buckets sent, and the most bytes assembled at once."""

    num_buckets: int = 0
    peak_bucket_bytes: int = 0  # receive buffers and local copies of one bucket
    largest_tensor_bytes: int = 0


class FullParameterStream:
    """Iterate for (name, tensor) pairs, or call `buckets()` for one list per bucket."""

    def __init__(
        self,
        module: nn.Module,
        index: GroupIndex,
        comm: Comm,
        gatherer: GroupGatherer | None,
        *,
        bucket_bytes: int,
        dtype: torch.dtype | None,
        merge_adapters: bool,
        device: torch.device,
        slices: Sequence[SliceRecord] = (),
    ) -> None:
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
            raise UsageError(
                f"full_parameters: bucket_bytes must be an int >= 1, got {bucket_bytes!r}"
            )
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise UsageError(f"full_parameters: dtype must be a torch.dtype or None, got {dtype!r}")
        if merge_adapters and slices:  # pragma: no cover - refused by the composition table
            raise RuntimeError("internal error: merging adapters into slices")
        self.index = index
        self.slices = list(slices)  # tensor- and expert-parallel slices are gathered whole
        self.comm = comm
        self.gatherer = gatherer
        self.dtype = dtype
        self.device = device
        self.report = StreamReport()
        entries = _entries(module, index, MergedNames(module) if merge_adapters else None)
        self._buckets = _pack(entries, bucket_bytes, dtype)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets():
            yield from bucket

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in self._buckets:
            yield self._assemble(bucket)

    @torch.no_grad()
    def _assemble(self, bucket: list[_Entry]) -> list[tuple[str, torch.Tensor]]:
        values: dict[int, torch.Tensor] = {}
        handles: list[Handle] = []
        nbytes = 0
        for run in _runs(bucket):
            received, pending = self._receive(run)
            handles += pending
            nbytes += received.numel() * received.element_size()
            start = run[0].state.flat.slot_of(run[0].position)[0]  # type: ignore[union-attr]
            for entry in run:
                lo, hi = entry.state.flat.slot_of(entry.position)  # type: ignore[union-attr]
                values[id(entry)] = received[lo - start : hi - start].view(entry.tensor.shape)
        with PlainTensorOps():
            for entry in bucket:
                if entry.state is None:
                    copy = entry.tensor.detach().clone()
                    values[id(entry)] = copy
                    nbytes += copy.numel() * copy.element_size()
        for handle in handles:
            handle.wait()
        out = []
        for entry in bucket:
            value = values[id(entry)]
            if self.slices:  # a collective over the slice's group, in bucket order
                value = whole_value(self.slices, entry.tensor, value)
            if entry.merge is not None:
                self._merge(entry.merge, value)
            if self.dtype is not None and value.dtype != self.dtype and value.is_floating_point():
                value = value.to(self.dtype)
            self.report.largest_tensor_bytes = max(
                self.report.largest_tensor_bytes, value.numel() * value.element_size()
            )
            out.append((entry.name, value))
        self.report.num_buckets += 1
        self.report.peak_bucket_bytes = max(self.report.peak_bucket_bytes, nbytes)
        return out

    def _receive(self, run: list[_Entry]) -> tuple[torch.Tensor, list[Handle]]:
        """One receive buffer for a run of consecutive parameters of one sharded group,
        filled by a broadcast from each rank that holds part of it (all in flight)."""
        state = run[0].state
        if state is None:  # pragma: no cover - runs are of sharded groups only
            raise RuntimeError("internal error: a run without its group")
        flat, comm = state.flat, state.comm  # the group it is sharded over
        lo = flat.slot_of(run[0].position)[0]
        hi = flat.slot_of(run[-1].position)[1]
        received = torch.empty(hi - lo, dtype=flat.dtype, device=self.device)
        shard_numel = flat.shard_numel
        handles = []
        for rank in range(comm.world_size):
            start = max(lo, rank * shard_numel)
            end = min(hi, (rank + 1) * shard_numel)
            if start >= end:
                continue
            part = received[start - lo : end - lo]
            if rank == comm.rank:
                offset = rank * shard_numel
                part.copy_(flat.shard[start - offset : end - offset])
            handles.append(comm.broadcast(part, src=rank, async_op=True))
        return received, handles

    def _merge(self, merge: LoraMerge, value: torch.Tensor) -> None:
        """The adapters' deltas, from their parameters gathered for the moment (a collective)."""
        states = sharded_groups_of(merge.lora_params(), self.index)
        with held(self.gatherer, states):
            merge.apply(value)


def _entries(module: nn.Module, index: GroupIndex, merged: MergedNames | None) -> list[_Entry]:
    """Every tensor of the state dict once (a tied one under its first name), located."""
    seen: set[int] = set()
    entries = []
    for key, tensor in module.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        name, merge = merged.resolve(key) if merged is not None else (key, None)
        if name is None:
            continue  # an adapter's own tensor (merged into its base weight)
        found = index.lookup(tensor)
        state, position = (found[0], found[1]) if found is not None else (None, 0)
        if state is not None and state.gather is None:
            state = None  # persistent: whole on every rank
        entries.append(_Entry(name, tensor, state, position, merge, tensor.numel()))
    return entries


def _pack(
    entries: list[_Entry], bucket_bytes: int, dtype: torch.dtype | None
) -> list[list[_Entry]]:
    """Sharded tensors in group order first (runs of one group stay together), then the rest."""
    sharded = sorted(
        (e for e in entries if e.state is not None),
        key=lambda e: (e.state.order, e.position),  # type: ignore[union-attr]
    )
    ordered = sharded + [e for e in entries if e.state is None]
    buckets: list[list[_Entry]] = []
    current: list[_Entry] = []
    size = 0
    for entry in ordered:
        itemsize = max(entry.tensor.element_size(), _itemsize(dtype))
        nbytes = entry.numel * itemsize
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _itemsize(dtype: torch.dtype | None) -> int:
    return 0 if dtype is None else torch.empty((), dtype=dtype).element_size()


def _runs(bucket: list[_Entry]) -> Iterator[list[_Entry]]:
    """Consecutive sharded entries of one group with consecutive positions."""
    run: list[_Entry] = []
    for entry in bucket:
        if entry.state is None:
            continue
        if run and (entry.state is not run[-1].state or entry.position != run[-1].position + 1):
            yield run
            run = []
        run.append(entry)
    if run:
        yield run
