"""What bench/expert_parallel.py counts: expert bytes held, and bytes sent by purpose.

zerodp:
- `ExpertGatherLedger` tells the gathers of expert elements from the others. Every
  stage 3 gather fills one flat group's full buffer (`GroupState.comm.all_gather(
  flat.full, ...)`); the ledger wraps `all_gather` on each group's `Comm` (an instance
  attribute, this process only) and, when the output is a group's full buffer, counts
  that group's expert elements as expert gathers. Everything else (the other gathers,
  the reductions, the all-to-alls) is read from `engine.comm.stats`, whose all-to-alls
  are only the token exchanges of expert parallelism here.
- `zerodp_expert_state_bytes`: the bytes of every flat group's parameters, gradients,
  fp32 copy and optimizer state, the expert share of each by its expert elements (a
  group of expert slices is all experts; without expert parallelism a block's group
  mixes experts with attention).

DeepSpeed:
- `GroupCollectiveCounter` wraps torch.distributed's collectives while active, like
  `bench._measure.CollectiveCounter`, and also the all-to-alls, and keeps the bytes by
  the process group they ran in (labelled from `deepspeed.utils.groups`: AutoEP's
  expert-parallel group, its expert-data group, or the world). An all-to-all counts
  what this rank sends to the others, as zerodp counts it; a collective over one rank
  sends nothing and is not counted.
- `deepspeed_state_bytes`: stage 3's own buffers (parameter partitions, the fp32
  partitions, the gradient partitions, the torch optimizer's state), each storage
  once, and the expert share of each by sub-group.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from bench._measure import _nbytes
from zerodp.comm.stats import CollectiveKind

# --- zerodp ---------------------------------------------------------------------------


def _expert_numel(state: Any, expert_names: set[str]) -> int:
    """Elements of `state`'s flat group that belong to expert tensors."""
    if state.flat.expert:
        return int(state.flat.layout.numel)
    return sum(
        slot.numel
        for name, slot in zip(state.flat.names, state.flat.layout.slots, strict=True)
        if name in expert_names
    )


def expert_names_of(engine: Any) -> set[str]:
    from bench._expert_parallel_model import is_expert_name

    return {n for n, _ in engine.module.named_parameters() if is_expert_name(n)}


class ExpertGatherLedger:
    """Bytes of expert elements gathered since `reset()` (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        names = expert_names_of(engine)
        self._expert_bytes_of = {
            id(s.flat.full): _expert_numel(s, names) * s.flat.full.element_size()
            for s in engine.groups.states
        }
        self.expert_bytes = 0
        self._wrapped: list[Any] = []
        for comm in {id(s.comm): s.comm for s in engine.groups.states}.values():
            self._wrap(comm)

    def _wrap(self, comm: Any) -> None:
        original = comm.all_gather

        def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Any:
            if comm.world_size > 1:
                self.expert_bytes += self._expert_bytes_of.get(id(output), 0)
            return original(output, input, async_op=async_op)

        comm.all_gather = all_gather
        self._wrapped.append(comm)

    def reset(self) -> None:
        self.expert_bytes = 0

    def close(self) -> None:
        for comm in self._wrapped:
            del comm.all_gather


def zerodp_traffic(engine: Any, ledger: ExpertGatherLedger) -> dict[str, int]:
    """One step's bytes by purpose, from the engine's stats and the ledger."""
    stats = engine.comm.stats
    gathers = stats.bytes[CollectiveKind.ALL_GATHER]
    return {
        "expert_gathers": ledger.expert_bytes,
        "other_gathers": gathers - ledger.expert_bytes,
        "reductions": stats.bytes[CollectiveKind.REDUCE_SCATTER]
        + stats.bytes[CollectiveKind.ALL_REDUCE],
        "token_all_to_all": stats.bytes[CollectiveKind.ALL_TO_ALL],
        "other": stats.bytes[CollectiveKind.BROADCAST],
    }


class _Extents:
    """Byte ranges of memory already counted: a view inside a counted tensor adds nothing,
    and views of one shared buffer are each counted for their own bytes (so each group's
    share is its own)."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []

    def add(self, tensor: Any) -> int:
        if not isinstance(tensor, torch.Tensor) or tensor.untyped_storage().nbytes() == 0:
            return 0
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if end == start:
            return 0
        covered = 0
        for lo, hi in self._ranges:
            covered += max(0, min(end, hi) - max(start, lo))
        self._ranges.append((start, end))
        return max(0, end - start - covered)


def zerodp_expert_state_bytes(engine: Any) -> tuple[int, int]:
    """(expert bytes, all bytes) of model state in the engine's flat groups, each storage
    once: the full buffer (while allocated), the shard, the kept gradient, the fp32 copy and
    the optimizer's state of the group's optimizer parameter."""
    names = expert_names_of(engine)
    inner = engine.optimizer.inner.state
    seen = _Extents()
    expert_total, total = 0, 0
    for state in engine.groups.states:
        tensors: list[Any] = [state.flat.full, state.flat.shard]
        if state.grads is not None:
            tensors.append(state.grads.storage)
        if state.optim is not None:
            tensors.append(state.optim.copy)
            tensors += list(inner.get(state.optim.param, {}).values())
        held = sum(seen.add(t) for t in tensors)
        share = _expert_numel(state, names) / max(1, state.flat.layout.numel)
        total += held
        expert_total += round(held * share)
    return expert_total, total


# --- DeepSpeed ------------------------------------------------------------------------

_OUT = ("output_tensor", "output", "tensor_list", "output_tensors")
_IN = ("input_tensor", "input", "input_list", "input_tensors")
_TENSOR = ("tensor", "tensors")
# torch.distributed's (and DeepSpeed's backend's) name -> (kind, position and keyword names
# of the tensor that sizes it, position of the group)
_WRAPPED: dict[str, tuple[str, int, tuple[str, ...], int]] = {
    "all_reduce": ("all_reduce", 0, _TENSOR, 2),
    "all_reduce_coalesced": ("all_reduce", 0, _TENSOR, 2),
    "all_gather_into_tensor": ("all_gather", 0, _OUT, 2),
    "_all_gather_base": ("all_gather", 0, _OUT, 2),
    "all_gather_base": ("all_gather", 0, _OUT, 2),
    "all_gather": ("all_gather", 0, _OUT, 2),
    "all_gather_coalesced": ("all_gather", 0, _OUT, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 1, _IN, 3),
    "_reduce_scatter_base": ("reduce_scatter", 1, _IN, 3),
    "reduce_scatter": ("reduce_scatter", 1, _IN, 3),
    "broadcast": ("broadcast", 0, _TENSOR, 2),
    "all_to_all_single": ("all_to_all", 1, _IN, 4),
    "all_to_all": ("all_to_all", 1, _IN, 2),
}


def deepspeed_group_labels(ep_size: int) -> dict[Any, str]:
    """AutoEP's groups by object: "expert" (tokens), "expert_data" (experts' ZeRO group)."""
    from deepspeed.utils import groups

    name = f"ep_size_{ep_size}"
    labels: dict[Any, str] = {}
    with contextlib.suppress(Exception):  # no AutoEP: only the world
        labels[groups._get_expert_parallel_group(name)] = "expert"
        labels[groups._get_expert_data_parallel_group(name)] = "expert_data"
    return labels


def _all_to_all_sent(args: tuple[Any, ...], kwargs: dict[str, Any], group: Any) -> int:
    """Bytes this rank sends to other ranks in an all-to-all (its own split excluded)."""
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    sent: Any = kwargs.get("input_tensor_list", kwargs.get("input"))
    if sent is None and len(args) > 1:
        sent = args[1]
    if isinstance(sent, list):  # all_to_all: one tensor per destination
        return sum(_nbytes(chunk) for index, chunk in enumerate(sent) if index != me)
    if not isinstance(sent, torch.Tensor):
        return 0
    splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
    total = _nbytes(sent)
    if not splits:  # equal splits
        return total - total // size
    rows = sent.shape[0] if sent.dim() else 1
    return total - (total // max(1, rows)) * int(splits[me])


class GroupCollectiveCounter:
    """Bytes per (group label, kind) of the collectives seen while `active()`."""

    def __init__(self, labels: dict[Any, str]) -> None:
        self.labels = labels
        self.bytes: Counter[tuple[str, str]] = Counter()
        self._local = threading.local()

    def _label(self, group: Any) -> str:
        return self.labels.get(group, "world")

    def _record(
        self, kind: str, pos: int, keywords: tuple[str, ...], gpos: int, args: Any, kwargs: Any
    ) -> None:
        group = kwargs.get("group", args[gpos] if len(args) > gpos else None)
        if dist.get_world_size(group) == 1:
            return
        if kind == "all_to_all":
            nbytes = _all_to_all_sent(args, kwargs, group)
        else:
            sizing = args[pos] if len(args) > pos else None
            if sizing is None:
                sizing = next((kwargs[k] for k in keywords if k in kwargs), None)
            nbytes = _nbytes(sizing)
        self.bytes[(self._label(group), kind)] += nbytes

    def _wrap(self, fn: Any, kind: str, pos: int, keywords: tuple[str, ...], gpos: int) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0) == 0:
                self._record(kind, pos, keywords, gpos, args, kwargs)
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth -= 1

        return counted

    @contextlib.contextmanager
    def active(self) -> Iterator[GroupCollectiveCounter]:
        """Count from zero while inside; everything patched is restored on the way out."""
        self.bytes.clear()
        saved: list[tuple[Any, str, Any, bool]] = []
        for target in (dist, dist.distributed_c10d, *_deepspeed_backend()):
            for name, spec in _WRAPPED.items():
                original = getattr(target, name, None)
                if callable(original):
                    own = name in getattr(target, "__dict__", {})
                    saved.append((target, name, original, own))
                    setattr(target, name, self._wrap(original, *spec))
        try:
            yield self
        finally:
            for target, name, original, own in reversed(saved):
                if own:
                    setattr(target, name, original)
                else:  # a method found on the class: drop our instance attribute
                    delattr(target, name)

    def traffic(self) -> dict[str, int]:
        """The step's bytes by purpose (zerodp_traffic's keys)."""
        out = dict.fromkeys(
            ("expert_gathers", "other_gathers", "reductions", "token_all_to_all", "other"), 0
        )
        for (label, kind), nbytes in self.bytes.items():
            if kind == "all_to_all":
                out["token_all_to_all"] += nbytes
            elif kind == "all_gather":
                out["expert_gathers" if label == "expert_data" else "other_gathers"] += nbytes
            elif kind in ("reduce_scatter", "all_reduce"):
                out["reductions"] += nbytes
            else:
                out["other"] += nbytes
        return out


def _deepspeed_backend() -> list[Any]:
    """DeepSpeed's comm backend object: it calls torch functions it looked up at start-up
    (its all-gather and reduce-scatter), which patching torch.distributed does not reach."""
    try:
        from deepspeed.comm import comm as ds_comm
    except ImportError:
        return []
    backend = getattr(ds_comm, "cdb", None)
    return [backend] if backend is not None else []


def _is_autoep_expert(param: Any) -> bool:
    return getattr(param, "allreduce", True) is False and hasattr(param, "group_name")


def deepspeed_state_bytes(engine: Any) -> tuple[int, int]:
    """(expert bytes, all bytes) of DeepSpeed stage 3's model state on this rank: each
    sub-group's parameter partition, its fp32 partition and the torch optimizer's state of
    that, each parameter's gradient partition, and the data of parameters kept whole
    (persistent); each byte once."""
    opt = engine.optimizer
    inner = opt.optimizer.state
    grads = getattr(opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", {})
    seen = _Extents()
    expert_total, total = 0, 0
    for index, params in enumerate(opt.fp16_groups):
        experts = bool(params) and all(_is_autoep_expert(p) for p in params)
        fp32 = opt.fp32_partitioned_groups_flat[index]
        tensors: list[Any] = [opt.fp16_partitioned_groups_flat[index], fp32]
        tensors += list(inner.get(fp32, {}).values())
        tensors += [grads.get(p.ds_id) for p in params]
        tensors += [p.data for p in params]  # empty unless gathered or persistent
        held = sum(seen.add(t) for t in tensors)
        total += held
        expert_total += held if experts else 0
    return expert_total, total
