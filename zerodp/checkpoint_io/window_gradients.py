"""The kept gradients of a checkpoint taken inside an accumulation window.

A save between micro-steps (or between a backward and its `step()`) keeps
what the window has accumulated, so a resumed run is bitwise the run that
was never interrupted. Two forms, per parameter, after the kept
gradient's `GradSync`:

- `grad.<name>`: an averaged gradient (stages 2 and 3; stages 0 and 1 after
  their boundary reduction) is one global 1-D tensor, each rank writing the
  part of its owned range, like the master weights; DCP reshards it.
- `grad_local.rank<r>.<name>`: a local sum (stages 0 and 1 inside the
  window) is rank r's own, unreduced. It loads back as it is into the same
  layout at a stage that accumulates locally (bitwise). Elsewhere every rank
  reads the sums the saved dims name (`ParallelDims.window_sum_sources`: the
  saved ranks of its tensor slice, summed over sequence ranks, divided by the
  data ranks), which is what the boundary reduction would have made of them.
- `grad_replica<r>.<name>`: a shard group's average (`GradSync.PARTIAL`:
  stages 2 and 3 with shard groups that replicate each other, inside the
  window) is replica r's own, written by shard group r. It loads back as it is
  into the same layout (bitwise); elsewhere every rank reads all of them and
  takes their average, as the boundary's all-reduce across replicas would (an
  expert tensor, saved whole at E = 1, then loaded at E > 1: the experts this
  rank holds, cut from that average).

Under another tensor-parallel degree the saved parts are slices of another cut: the
local sums and the replicas' averages of each saved slice are read across the cuts
(`zerodp.checkpoint_io.tensor_relayout`), combined as above, and cut as this engine's
slice; an averaged gradient is read across cuts like the master weights.

The description in zerodp_state.json records the parallel dims the window was
kept under (`ParallelDims.to_record`; how the saved parts combine is theirs to
say, not this module's), the accumulation steps (a window's gradients only
mean something with the same number of micro-steps)
and the loss scale they carry (fp16), so a load under another scale
rescales them. "Another scale" is the one the engine has after the load: a
load with the optimizer state brings the saved loss scaler back (so the
gradients stay as saved); `load_optimizer_states=False` keeps the engine's
own scale, and the gradients are rescaled to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.checkpoint_io.tensor_relayout import Relayout, SavedParts
from zerodp.checkpoint_io.tensors import ParamEntry, as_entry, param_entries
from zerodp.errors import CheckpointError
from zerodp.group_state import GradSync, GroupState
from zerodp.parallel import REPLICA, ParallelDims
from zerodp.parallel.tensor_slices import TensorSlices
from zerodp.partition import Slicing

AVERAGED = "grad."
EXPERT_KEY = "expert_slices"  # zerodp_state.json: the names saved as each rank's experts
LOCAL = "grad_local.rank"
PARTIAL = "grad_replica"


def describe(subject: CheckpointSubject) -> dict[str, Any] | None:
    """What zerodp_state.json says about the kept gradients; None when they hold nothing."""
    if not subject.gradients_held():
        return None
    return {
        "accumulation_steps": subject.accumulation_steps,
        "loss_scale": float(subject.loss_scale()),
        "world_size": subject.comm.world_size,
        "num_replicas": subject.dims.num_replicas,
        "dims": subject.dims.to_record(),
    }


def gradient_tensors(subject: CheckpointSubject) -> dict[str, Any]:
    """This rank's part of every kept gradient, keyed as the module docstring says."""
    rank = subject.comm.rank
    # A replica's partial average is its own (each replica writes its own key); the rest is
    # written by the first replica.
    own, first = subject.places(saving=False), subject.places(saving=True)
    out: dict[str, Any] = {}
    for entry in param_entries(subject):
        state = entry.state
        if state is None or state.grads is None:
            continue
        kept = state.grads
        if kept.sync is GradSync.LOCAL:
            start, end = state.flat.slot_of(entry.position)
            out[f"{LOCAL}{rank}.{entry.name}"] = kept.storage[start:end]
        elif kept.sync is GradSync.PARTIAL:
            key = f"{PARTIAL}{subject.dims.replica_index}.{entry.name}"
            out[key] = as_entry(kept.owned(), state, entry.position, own)
        else:
            out[f"{AVERAGED}{entry.name}"] = as_entry(kept.owned(), state, entry.position, first)
    return out


@dataclass
class GradientLoad:
    """Where a load reads the kept gradients, and how it then puts them in place."""

    destinations: dict[str, Any] = field(default_factory=dict)
    steps: list[Callable[[], None]] = field(default_factory=list)
    rescale: float = 1.0
    own_partial: dict[GroupState, torch.Tensor] = field(default_factory=dict)  # per group

    def apply(self, subject: CheckpointSubject) -> None:
        """After the load (gradients zeroed): fill the kept gradients and mark them held."""
        if not self.steps:
            return
        for step in self.steps:
            step()
        if self.rescale != 1.0:
            for state in subject.groups.trainable:
                if state.grads is not None:
                    state.grads.storage.mul_(self.rescale)
        subject.gradients_loaded()


def plan_load(
    subject: CheckpointSubject,
    shared: dict[str, Any],
    saved: dict[str, Any],
    with_loss_scaler: bool,
    relayout: Relayout | None = None,
) -> GradientLoad:
    """Check that the saved gradients fit this engine and plan reading them (nothing changes).

    `with_loss_scaler`: the load restores the saved loss scaler (the optimizer state is
    loaded), so the scale after the load is the checkpoint's, not the engine's current one.
    `relayout`: the parameters cut otherwise than saved (another T), read across cuts.
    """
    info = shared.get("gradients")
    plan = GradientLoad()
    if info is None:
        return plan
    _check_info(info, subject.accumulation_steps)
    saved_dims = _saved_dims(info)
    cuts = {} if relayout is None else relayout.cuts
    # As saved only with every cut as saved: under another tensor_parallel plan at the same
    # dims, a weight cut otherwise is combined (averaged), so every weight of its group must be.
    same_dims = saved_dims.same_layout(subject.dims) and not cuts
    same_layout = same_dims and subject.local_accumulation
    # A weight left whole has the same sums on every tensor rank: under another T, rank 0's.
    same_t = saved_dims.tensor_size == subject.dims.tensor_size
    sources = saved_dims.window_sum_sources(subject.dims.tensor_rank if same_t else 0)
    saved_replicas = saved_dims.num_replicas
    saved_experts = _saved_experts(shared)
    fresh: dict[GroupState, torch.Tensor] = {}
    for entry in param_entries(subject):
        state = entry.state
        if state is None or state.grads is None:
            continue
        kept = state.grads
        experts_now = entry.slicing is Slicing.EXPERT
        saved_as_slices = entry.name in saved_experts
        if (
            (saved_as_slices or experts_now)
            and not same_layout
            and _plan_experts(plan, subject, saved_dims, entry, saved_as_slices, saved)
        ):
            continue
        averaged_key = f"{AVERAGED}{entry.name}"
        local_keys = [f"{LOCAL}{r}.{entry.name}" for r in sources.ranks]
        partial_keys = [f"{PARTIAL}{r}.{entry.name}" for r in range(saved_replicas)]
        if entry.name in cuts and averaged_key not in saved:
            if relayout is None:  # pragma: no cover - cuts come from the relayout
                raise RuntimeError("internal error: cuts without a relayout")
            parts = _saved_parts(saved_dims, cuts[entry.name][0], entry.name, saved)
            if parts is not None:
                _plan_relaid(plan, relayout, subject, entry.name, entry.position, state, parts)
        elif partial_keys[0] in saved:
            divisor = saved_dims.gradient_divisor(REPLICA)
            _plan_partial(plan, subject, entry.position, state, partial_keys, same_dims, divisor)
        elif averaged_key in saved:
            owned = fresh.get(state)
            if owned is None:
                owned = fresh[state] = torch.zeros_like(kept.owned())
                plan.steps.append(_put_averaged(state, owned))
            plan.destinations[averaged_key] = as_entry(
                owned, state, entry.position, subject.places(saving=False)
            )
        elif all(key in saved for key in local_keys):
            numel = state.flat.layout.slots[entry.position].numel
            if same_layout:
                own = torch.zeros(numel, dtype=kept.storage.dtype, device=kept.storage.device)
                plan.destinations[f"{LOCAL}{subject.comm.rank}.{entry.name}"] = own
                plan.steps.append(_put_local(state, entry.position, own))
            else:
                sums = [torch.zeros(numel, dtype=torch.float32) for _ in local_keys]
                plan.destinations.update(zip(local_keys, sums, strict=True))
                plan.steps.append(_put_combined_sums(state, entry.position, sums, sources.divisor))
        elif any(key in saved for key in local_keys):
            raise _incomplete(entry.name)
    if with_loss_scaler:
        scale_after_load = float(shared["loss_scaler"]["scale"])  # checked before this
    else:
        scale_after_load = float(subject.loss_scale())
    if scale_after_load != info["loss_scale"]:
        plan.rescale = scale_after_load / float(info["loss_scale"])
    return plan


def _saved_experts(shared: dict[str, Any]) -> frozenset[str]:
    names = shared.get(EXPERT_KEY, [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"checkpoint state: '{EXPERT_KEY}' is damaged")
    return frozenset(names)


def _plan_experts(
    plan: GradientLoad,
    subject: CheckpointSubject,
    saved_dims: ParallelDims,
    entry: ParamEntry,
    saved_as_slices: bool,
    saved: dict[str, Any],
) -> bool:
    """A window's sums of an expert tensor saved or loaded as EP ranks' slices (another E, or
    another layout): each saved slice e's local sums summed over the saved ranks holding
    experts e and divided as the saved dims say (or, for a tensor saved whole by shard groups,
    the replicas' averages averaged), the slices put together along the experts, and this
    rank's experts cut from that whole (E equal consecutive ranges, EP rank k holding range
    k). False: neither (the averaged form loads at any E by itself, as the model's values
    do)."""
    name, state = entry.name, entry.state
    if state is None:  # pragma: no cover - planned for trainable groups only
        raise RuntimeError("internal error: no group")
    whole_shape = subject.recorded_shapes()[name]
    slices = saved_dims.expert_size if saved_as_slices else 1
    parts = _expert_parts(saved_dims, name, saved_as_slices, saved)
    if parts is None:
        return False
    numel = math.prod(whole_shape)
    sums = [[torch.zeros(numel // slices, dtype=torch.float32) for _ in part] for part, _ in parts]
    for (part_keys, _), part_sums in zip(parts, sums, strict=True):
        plan.destinations.update(zip(part_keys, part_sums, strict=True))
    row = numel // whole_shape[0]  # one expert's elements
    held = state.flat.layout.slots[entry.position].numel
    first = 0
    if entry.slicing is Slicing.EXPERT:
        first = subject.dims.expert_slice(whole_shape[0]).start * row

    def combined() -> torch.Tensor:
        whole = torch.cat(
            [torch.stack(s).sum(0).div_(d) for s, (_, d) in zip(sums, parts, strict=True)]
        )
        if held % row:  # pragma: no cover - an expert slice holds whole experts
            raise RuntimeError("internal error: a slice of part of an expert")
        return whole[first : first + held]

    plan.steps.append(_put_combined_sums(state, entry.position, [], 1, combined))
    return True


def _expert_parts(
    saved_dims: ParallelDims, name: str, saved_as_slices: bool, saved: dict[str, Any]
) -> list[tuple[list[str], int]] | None:
    """For each saved slice of an expert tensor (one: saved whole), the keys whose sum makes
    it up and what that sum is divided by: the local sums of the saved ranks holding those
    experts; else, saved whole by shard groups (`mics_shard_size`, E = 1), the replicas'
    averages. None: neither is saved."""
    slices = saved_dims.expert_size if saved_as_slices else 1
    sources = [
        saved_dims.window_sum_sources(0, e if saved_as_slices else None) for e in range(slices)
    ]
    local = [([f"{LOCAL}{r}.{name}" for r in part.ranks], part.divisor) for part in sources]
    replicas = [f"{PARTIAL}{r}.{name}" for r in range(saved_dims.num_replicas)]
    for parts in (local, [(replicas, saved_dims.gradient_divisor(REPLICA))]):
        found = [key in saved for keys, _ in parts for key in keys]
        if all(found):
            return parts
        if any(found):
            raise _incomplete(name)
        if saved_as_slices:
            return None  # shard groups never hold EP ranks' slices
    return None


def _check_info(info: Any, accumulation_steps: int) -> None:
    if not isinstance(info, dict) or not all(
        isinstance(info.get(k), (int, float)) and not isinstance(info.get(k), bool)
        for k in ("accumulation_steps", "loss_scale", "world_size")
    ):
        raise CheckpointError(
            "checkpoint state: 'gradients' is damaged; the checkpoint's zerodp_state.json is "
            "damaged"
        )
    if info["accumulation_steps"] != accumulation_steps:
        raise CheckpointError(
            "the checkpoint was taken inside an accumulation window of "
            f"{info['accumulation_steps']} micro-steps (it holds the gradients accumulated so "
            f"far); this engine accumulates {accumulation_steps}: set "
            f"gradient_accumulation_steps to {info['accumulation_steps']}, or resume from a "
            "checkpoint saved at an accumulation boundary"
        )
    if not (info["loss_scale"] > 0 and info["world_size"] >= 1):
        raise CheckpointError("checkpoint state: 'gradients' is damaged (scale or world size)")


def _incomplete(name: str) -> CheckpointError:
    return CheckpointError(
        f"the checkpoint's accumulated gradient of '{name}' lacks some ranks' parts; the "
        "checkpoint is incomplete"
    )


def _saved_parts(
    saved_dims: ParallelDims, cut: TensorSlices, name: str, saved: dict[str, Any]
) -> SavedParts | None:
    """Where a window's gradient of `name`, saved per rank or per replica, has each part of
    its saved cut: the replicas' averages (each holding every part), averaged as the
    boundary would; or the local sums of the saved ranks of each part's tensor slice
    (a weight left whole: tensor rank 0's), combined as the saved dims say. None: the
    window kept no gradient of `name` (it was frozen), which stays zero as elsewhere."""
    parts = range(cut.count)
    replicas = [f"{PARTIAL}{r}.{name}" for r in range(saved_dims.num_replicas)]
    if replicas[0] in saved:
        if not all(key in saved for key in replicas):
            raise _incomplete(name)
        divisor = saved_dims.gradient_divisor(REPLICA)
        return SavedParts(
            cut, tuple(tuple(replicas) for _ in parts), tuple(cut.offset(p) for p in parts), divisor
        )
    sources = [saved_dims.window_sum_sources(p if cut.count > 1 else 0) for p in parts]
    keys = tuple(tuple(f"{LOCAL}{r}.{name}" for r in source.ranks) for source in sources)
    found = [key in saved for part in keys for key in part]
    if not any(found):
        return None
    if not all(found):
        raise _incomplete(name)
    return SavedParts(cut, keys, tuple(0 for _ in parts), sources[0].divisor)


def _plan_relaid(
    plan: GradientLoad,
    relayout: Relayout,
    subject: CheckpointSubject,
    name: str,
    position: int,
    state: GroupState,
    parts: SavedParts,
) -> None:
    """This rank's part of a window's gradient cut otherwise than saved: read across the cuts
    (see [Note: another tensor-parallel degree]), averaged as the boundary would have."""
    relayout.need(name)
    cut = relayout.cuts[name][1]
    part = subject.dims.tensor_rank if cut.count > 1 else 0
    flat = state.flat
    if flat.owns_full:
        start, end = flat.slot_of(position)
        param_start = 0
    else:
        overlap = flat.layout.overlap(position, flat.rank)
        if overlap is None:
            return
        start, end, param_start = overlap.shard_start, overlap.shard_end, overlap.param_start
    values = torch.zeros(end - start, dtype=torch.float32)
    relayout.add(name, parts, part, param_start, values)
    plan.steps.append(_put_region(state, start, end, values))


def _saved_dims(info: dict[str, Any]) -> ParallelDims:
    """The dims the window was kept under. A checkpoint from before they were recorded was
    saved without sequence or tensor parallelism where it kept local sums (the only layouts
    whose window loads were right then): its world ranks are its data ranks."""
    record = info.get("dims")
    if record is None:
        try:
            return ParallelDims.from_replicas(info["world_size"], info.get("num_replicas", 1))
        except ValueError:
            raise CheckpointError("checkpoint state: 'gradients' is damaged (replicas)") from None
    try:
        return ParallelDims.from_record(record)
    except ValueError as caught:
        raise CheckpointError(
            f"checkpoint state: 'gradients.dims' is damaged ({caught}); the checkpoint's "
            "zerodp_state.json is damaged"
        ) from None


def _plan_partial(
    plan: GradientLoad,
    subject: CheckpointSubject,
    position: int,
    state: GroupState,
    keys: list[str],
    same_replicas: bool,
    divisor: int,
) -> None:
    """Shard groups' averages: this replica's own into the same layout, else their average
    over the saved replicas (`divisor`, asked of the saved dims)."""
    kept = state.grads
    if kept is None:  # pragma: no cover - planned for trainable groups only
        raise RuntimeError("internal error: no kept gradient")
    if same_replicas and not kept.covers_full:  # stages 2-3 with the saved shard groups
        own = plan.own_partial.get(state)
        if own is None:
            own = plan.own_partial[state] = torch.zeros_like(kept.owned())
            plan.steps.append(_put_partial(state, own))
        places = subject.places(saving=False)
        plan.destinations[keys[subject.dims.replica_index]] = as_entry(own, state, position, places)
        return
    numel = state.flat.layout.slots[position].numel
    averages = [torch.zeros(numel, dtype=torch.float32) for _ in keys]
    plan.destinations.update(zip(keys, averages, strict=True))
    plan.steps.append(_put_combined_sums(state, position, averages, divisor))


def _put_partial(state: GroupState, owned: torch.Tensor) -> Callable[[], None]:
    def put() -> None:
        kept = state.grads
        if kept is None:  # pragma: no cover
            raise RuntimeError("internal error: no kept gradient")
        kept.owned().copy_(owned)
        kept.sync = GradSync.PARTIAL

    return put


def _put_region(
    state: GroupState, start: int, end: int, values: torch.Tensor
) -> Callable[[], None]:
    def put() -> None:
        kept = state.grads
        if kept is None:  # pragma: no cover - planned for trainable groups only
            raise RuntimeError("internal error: no kept gradient")
        kept.owned()[start:end].copy_(values)
        kept.sync = GradSync.AVERAGED

    return put


def _put_averaged(state: GroupState, owned: torch.Tensor) -> Callable[[], None]:
    def put() -> None:
        kept = state.grads
        if kept is None:  # pragma: no cover - planned for trainable groups only
            raise RuntimeError("internal error: no kept gradient")
        kept.owned().copy_(owned)
        kept.sync = GradSync.AVERAGED

    return put


def _put_local(state: GroupState, position: int, values: torch.Tensor) -> Callable[[], None]:
    def put() -> None:
        kept = state.grads
        if kept is None:  # pragma: no cover
            raise RuntimeError("internal error: no kept gradient")
        start, end = state.flat.slot_of(position)
        kept.storage[start:end].copy_(values)
        kept.sync = GradSync.LOCAL

    return put


def _put_combined_sums(
    state: GroupState,
    position: int,
    sums: list[torch.Tensor],
    divisor: int,
    combined: Callable[[], torch.Tensor] | None = None,
) -> Callable[[], None]:
    """The saved parts summed and divided by what the saved dims say (never counted here);
    `combined` computes that value itself where the parts are not one slice's sums."""

    def put() -> None:
        kept = state.grads
        if kept is None:  # pragma: no cover
            raise RuntimeError("internal error: no kept gradient")
        average = combined() if combined is not None else torch.stack(sums).sum(0).div_(divisor)
        flat = state.flat
        if flat.owns_full:
            start, end = flat.slot_of(position)
            kept.owned()[start:end].copy_(average)
        else:
            overlap = flat.layout.overlap(position, flat.rank)
            if overlap is not None:
                part = average[overlap.param_start : overlap.param_start + overlap.numel]
                kept.owned()[overlap.shard_start : overlap.shard_end].copy_(part)
        kept.sync = GradSync.AVERAGED

    return put
