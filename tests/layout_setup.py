"""A checkpoint saved under one layout (data D, sequence S, tensor T, stage) and loaded under
another, against the uninterrupted run computed in the worker (importable by workers).

The runs are those of `tests.sequence_setup` (the tiny Llama, 13-token sequences, a user's
plain loop): `Case` with `tensor` > 1 adds `tensor_parallel.autotp_size`. The reference is
one process on the whole model (`sequence_setup.Reference`): every data rank's micro-batch
of each step, each loss over (its step's data ranks x accumulation), so a run that changes D
at a resume is compared with the same samples averaged as each run averaged them (a window
saved after its first micro-batch averages that one over the saved D and the second over
the new D: what the uninterrupted run at the saved D followed by the new D computes).

`save_both` trains one step beside the reference, saves at the boundary (tag "boundary"),
runs the next window's first micro-batch and saves inside the window (tag "window"); with
each checkpoint it writes the saving engine's whole weights (`weights-<tag>.pt`, rank 0).
`resume` loads one of them under another layout and stage, compares the loaded weights
with the saved ones (bitwise: a load only moves values), then trains on beside the
reference: for a window, its second micro-batch, the step (the combined window gradient
shows in the weights, with SGD directly), and one more step; at a boundary, two steps.
Every loss, global norm and weight is compared with `sequence_setup.TOLERANCE` (1e-5,
fp32): the reference adds the same terms in another order (whole matmuls against slices
summed by an all-reduce, attention over whole sequences against head shards), so the
runs agree to fp32 round-off, not bitwise; a wrong slice, a moment read from the wrong
offset or a window gradient averaged over the wrong ranks moves weights by the update
itself (AdamW at lr 1e-2: about 1e-2 an element a step), three orders of magnitude more.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import zerodp
from tests.hf_models import build_llama
from tests.sequence_setup import (
    TOLERANCE,
    Case,
    Reference,
    batch,
    check_weights,
    close,
    train_and_compare,
)
from zerodp.checkpoint_io import tensor_relayout

STEPS = 1  # steps before the saves


def layout(stage: int, *, tensor: int = 1, sequence: int = 1, optimizer: str = "sgd") -> Case:
    """A case of two micro-batches per step (a window to save inside) at (S, T, stage)."""
    extra = {"tensor_parallel": {"autotp_size": tensor}} if tensor > 1 else {}
    return Case(stage, sequence=sequence, gas=2, optimizer=optimizer, extra=extra)


def describe(case: Case) -> str:
    tensor = case.extra.get("tensor_parallel", {}).get("autotp_size", 1)
    return f"stage {case.stage}, S={case.sequence}, T={tensor}, {case.optimizer}"


def _save_weights(engine: Any, directory: str, tag: str) -> None:
    whole = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(whole, os.path.join(directory, f"weights-{tag}.pt"))
    dist.barrier()


def save_both(case: Case, directory: str) -> dict[str, Any]:
    """Train `STEPS` steps of `case` beside the reference; save at the boundary; run the next
    window's first micro-batch and save inside the window."""
    model = build_llama(0)
    reference = Reference(case, copy.deepcopy(model))
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    try:
        worst = train_and_compare(case, engine, model, reference, range(STEPS))
        engine.save_checkpoint(directory, tag="boundary")
        _save_weights(engine, directory, "boundary")
        out = engine(**batch(case, STEPS, 0, engine.data_parallel_rank))
        engine.backward(out.loss)
        engine.step()  # not a boundary: nothing steps
        engine.save_checkpoint(directory, tag="window")
        _save_weights(engine, directory, "window")
        replicas = engine.data_parallel_size
    finally:
        engine.destroy()
    return {"data_parallel_size": replicas, **worst}


def _loaded_weights_differ(engine: Any, directory: str, tag: str) -> float:
    saved = torch.load(os.path.join(directory, f"weights-{tag}.pt"), weights_only=True)
    loaded = engine.state_dict()
    if set(saved) != set(loaded):
        raise AssertionError(f"names differ: {sorted(set(saved) ^ set(loaded))}")
    return max((loaded[k].float() - saved[k].float()).abs().max().item() for k in saved)


def resume(
    saved: Case, saved_replicas: int, case: Case, directory: str, tag: str
) -> dict[str, Any]:
    """Load checkpoint `tag` of `save_both(saved, ...)` under `case` and train on beside the
    reference (see the module docstring); the largest differences seen."""
    model = build_llama(0)
    reference = Reference(case, copy.deepcopy(model))
    replay = Reference(saved, reference.model)
    replay.optimizers = reference.optimizers
    for step in range(STEPS):
        replay.step(step, saved_replicas)
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    replicas, mine = engine.data_parallel_size, engine.data_parallel_rank
    where = f"{describe(saved)} D={saved_replicas} -> {describe(case)} D={replicas}, {tag}"
    try:
        path, _ = engine.load_checkpoint(directory, tag=tag)
        if path is None:
            raise AssertionError(f"{where}: nothing loaded")
        worst: dict[str, float] = {"loaded": _loaded_weights_differ(engine, directory, tag)}
        if tag == "window":
            losses, norm = reference.step(STEPS, replicas, first_replicas=saved_replicas)
            out = engine(**batch(case, STEPS, 1, mine))
            worst["loss"] = close(out.loss, losses[1][mine], f"{where}: loss", TOLERANCE)
            engine.backward(out.loss)
            engine.step()
            worst["norm"] = close(engine.get_global_grad_norm(), norm, f"{where}: norm")
            worst["weights"] = check_weights(model, reference, where, engine)
            after = train_and_compare(case, engine, model, reference, range(STEPS + 1, STEPS + 2))
        else:
            after = train_and_compare(case, engine, model, reference, range(STEPS, STEPS + 2))
        for key, value in after.items():
            worst[key] = max(worst.get(key, 0.0), value)
    finally:
        engine.destroy()
    return {"where": where, "data_parallel_size": replicas, **worst}


@dataclass(frozen=True)
class Load:
    """Load checkpoint `tag` ("boundary" or "window") of the save named `saved` under `case`;
    `round_bytes`: the relayout's rounds (None: its default; 1: one parameter a round)."""

    saved: str
    case: Case
    tag: str
    round_bytes: int | None = None


def sweep(saves: list[tuple[str, Case]], loads: list[Load], workdir: str) -> dict[str, Any]:
    """Every save of `saves` (name, case), then every load of `loads`, in one spawn; a save's
    name is its directory under `workdir`. Each result carries its wall time."""
    out: dict[str, Any] = {"saves": {}, "loads": []}
    replicas = {}
    for name, case in saves:
        began = time.perf_counter()
        result = save_both(case, os.path.join(workdir, name))
        out["saves"][name] = {**result, "seconds": time.perf_counter() - began}
        replicas[name] = result["data_parallel_size"]
    cases = dict(saves)
    default_rounds = tensor_relayout.ROUND_BYTES
    for load in loads:
        began = time.perf_counter()
        tensor_relayout.ROUND_BYTES = load.round_bytes or default_rounds
        try:
            directory = os.path.join(workdir, load.saved)
            result = resume(cases[load.saved], replicas[load.saved], load.case, directory, load.tag)
        finally:
            tensor_relayout.ROUND_BYTES = default_rounds
        out["loads"].append({**result, "seconds": time.perf_counter() - began})
    return out
