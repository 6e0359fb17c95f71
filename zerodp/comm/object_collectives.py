"""Python objects through gloo collectives that zerodp can poll while they wait.

torch's `all_gather_object` and `broadcast_object_list` block inside the backend,
so a rank stuck in one (a checkpoint's agreement while a peer is still training)
never hears why ([Note: uneven inputs] in `zerodp.comm.faults.uneven_inputs`). These do
the same with asynchronous tensor collectives that `finish` waits for, polled:
the pickled bytes' lengths first, then the bytes, padded to the longest. Only
zerodp's own small records travel this way, between ranks of one job.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerodp.comm.single_tensor import all_gather_single

Finish = Callable[[Any, bool], Any]  # Comm._finish: wait for a work, polled


def gather_objects(obj: Any, group: Any, world_size: int, finish: Finish) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    data = _bytes_of(obj)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    lengths = torch.empty(world_size, dtype=torch.int64)
    finish(all_gather_single(lengths, length, group=group, async_op=True), False)
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = torch.empty(world_size * longest, dtype=torch.uint8)
    finish(all_gather_single(gathered, padded, group=group, async_op=True), False)
    return [
        _object_of(gathered[rank * longest : rank * longest + int(lengths[rank])])
        for rank in range(world_size)
    ]


def broadcast_object(obj: Any, src: int, group: Any, finish: Finish) -> Any:
    """`obj` from global rank `src` on every rank."""
    is_source = dist.get_rank() == src
    data = _bytes_of(obj) if is_source else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    finish(dist.broadcast(length, src=src, group=group, async_op=True), False)
    if not is_source:
        data = torch.empty(int(length), dtype=torch.uint8)
    finish(dist.broadcast(data, src=src, group=group, async_op=True), False)
    return obj if is_source else _object_of(data)


def _bytes_of(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _object_of(data: torch.Tensor) -> Any:
    return pickle.loads(bytes(data.tolist()))  # small records: a list of ints is fine
