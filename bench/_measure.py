"""What the benchmark measures besides time: collective bytes and per-rank model-state bytes.

zerodp counts its own traffic (`engine.comm.stats`); the other engines do not,
so `CollectiveCounter` wraps torch.distributed's Python collectives for the
duration of one measured step and counts each call the way zerodp does: the
bytes of the full tensor a collective works on (all-gather output,
reduce-scatter input, all-reduce and broadcast tensor). A thread-local depth
guard makes a collective that calls another one (torch's deprecated aliases
call the new names) count once.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerodp.monitor import ModelStateBytes

# name -> (kind, positional index of the tensor that sizes it, keyword names for it)
_COLLECTIVES: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "all_reduce": ("all_reduce", 0, ("tensor",)),
    "all_reduce_coalesced": ("all_reduce", 0, ("tensors",)),
    "all_gather_single": ("all_gather", 0, ("output_tensor", "output")),
    "all_gather_into_tensor": ("all_gather", 0, ("output_tensor", "output")),
    "_all_gather_base": ("all_gather", 0, ("output_tensor", "output")),
    "all_gather": ("all_gather", 0, ("tensor_list",)),
    "all_gather_coalesced": ("all_gather", 0, ("output_tensor_lists",)),
    "reduce_scatter_single": ("reduce_scatter", 1, ("input", "input_tensor")),
    "reduce_scatter_tensor": ("reduce_scatter", 1, ("input", "input_tensor")),
    "_reduce_scatter_base": ("reduce_scatter", 1, ("input", "input_tensor")),
    "reduce_scatter": ("reduce_scatter", 1, ("input_list",)),
    "broadcast": ("broadcast", 0, ("tensor",)),
    "reduce": ("reduce", 0, ("tensor",)),
}


def _nbytes(value: Any) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(item) for item in value)
    return 0


def _sizing_arg(
    args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, names: Iterable[str]
) -> Any:
    if len(args) > pos:
        return args[pos]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return None


class CollectiveCounter:
    """Bytes and calls per collective kind seen while `active()`; zero outside it."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._enabled = False

    def record(self, kind: str, nbytes: int) -> None:
        if not self._enabled or getattr(self._local, "depth", 0) > 0:
            return
        with self._lock:
            self.bytes[kind] += nbytes
            self.calls[kind] += 1

    @contextlib.contextmanager
    def nested(self) -> Iterator[None]:
        """Calls made inside were already counted by the caller: do not count them again."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {k: {"bytes": self.bytes[k], "calls": self.calls[k]} for k in sorted(self.bytes)}

    @contextlib.contextmanager
    def active(self, extra_targets: Iterable[Any] = ()) -> Iterator[CollectiveCounter]:
        """Count from zero while inside; torch.distributed is restored on the way out.

        `extra_targets` are further objects whose same-named methods issue
        collectives through a reference captured before we could patch (DeepSpeed's
        comm backend keeps one to all_gather_into_tensor).
        """
        self.bytes.clear()
        self.calls.clear()
        targets = [dist, dist.distributed_c10d, *extra_targets]
        saved: list[tuple[Any, str, Any, bool]] = []
        try:
            for target in targets:
                for name, spec in _COLLECTIVES.items():
                    original = getattr(target, name, None)
                    if callable(original):
                        own = name in getattr(target, "__dict__", {})
                        saved.append((target, name, original, own))
                        setattr(target, name, self._wrap(original, *spec))
            self._enabled = True
            yield self
        finally:
            self._enabled = False
            for target, name, original, own in reversed(saved):
                if own:
                    setattr(target, name, original)
                else:  # a method found on the class: drop our instance attribute
                    delattr(target, name)

    def _wrap(self, fn: Callable[..., Any], kind: str, pos: int, names: tuple[str, ...]) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.record(kind, _nbytes(_sizing_arg(args, kwargs, pos, names)))
            with self.nested():
                return fn(*args, **kwargs)

        return counted


def counting_allreduce_hook(counter: CollectiveCounter) -> Callable[..., Any]:
    """A DDP comm hook: count the bucket, then DDP's default all-reduce (not counted again).

    DDP reduces in C++ where Python wrappers cannot see it; routing its buckets
    through this hook makes the traffic visible at the cost of one Python call
    per bucket.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # No annotations: DDP compares them with the real classes, and ours would be strings.
    def hook(state, bucket):
        counter.record("all_reduce", _nbytes(bucket.buffer()))
        with counter.nested():
            return allreduce_hook(state, bucket)

    return hook


# --- model-state bytes ---------------------------------------------------------------


def _local(tensor: Any) -> Any:
    """A DTensor's local shard (what this rank holds); any other tensor unchanged."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _storage_bytes(tensors: Iterable[Any], seen: set[tuple[int, int]]) -> int:
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        storage = _local(tensor).untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key[1] == 0 or key in seen:
            continue
        seen.add(key)
        total += key[1]
    return total


def sharded_model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> ModelStateBytes:
    """`plain_model_state_bytes` for DTensor parameters (FSDP2): count each local shard once."""
    seen: set[tuple[int, int]] = set()
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()]
    return ModelStateBytes(
        params=_storage_bytes(params, seen),
        grads=_storage_bytes((p.grad for p in params if p.grad is not None), seen),
        optimizer=_storage_bytes(state, seen),
    )


# --- timing ---------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait for queued accelerator work, so a timer reads finished steps (no-op on CPU)."""
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if callable(sync):
        sync(device)


def timed(run: Callable[[], None], device: torch.device) -> float:
    """Seconds `run` takes on the slowest rank, all ranks starting together."""
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def median_min(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), min(samples)
