"""Tensor parallelism side by side: zerodp, FSDP2 + DTensor TP and DeepSpeed's AutoTP.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 \\
        bench/tensor_parallel.py [--tensor 2] [--steps 8] [--repeats 3] \\
        [--engines zerodp,fsdp2,deepspeed]

Backs the table in docs/tensor-parallel.md. One run, one model, one mesh: world = T x D
(default T = 2, D = world / T), ranks d*T .. d*T+T-1 a tensor group. The model is the tests'
tiny Llama (2 layers, hidden 32, 4 query heads, 2 key/value heads, tied embeddings, fp32),
built from the same seed by every engine; the data are the same per (step, data rank): a
tensor group reads the same two rows, the D data ranks different ones. Every engine trains
fp32 AdamW (lr 1e-3, weight decay 0, no clipping) for `--steps` steps.

The reference, computed in each process first: the whole model on every data rank's rows,
each loss divided by D, torch's AdamW; its losses, global gradient norms and weights.

Per engine, against the reference: the largest difference of the weights after the last
step (zerodp and FSDP2: whole tensors; DeepSpeed: each rank's slices against the same slices
of the reference, the largest over ranks), of every loss, and of every step's global norm;
the fastest step (forward, backward, step; of the steps after the first, on the slowest
rank, over `--repeats` runs of every engine in turn: the least disturbed by other work on a
shared machine);
model-state bytes per rank (parameters, gradients, optimizer state, after the last step;
zerodp's `engine.model_state_bytes()`, FSDP2's local shards; DeepSpeed's are in its own flat
buffers, not counted); each time as a multiple of zerodp's at the same ZeRO stage (FSDP2
against stage 3) measured in the same run.

- `zerodp` runs `"tensor_parallel": {"autotp_size": T}` at ZeRO stages 1-3: the HF plan the
  model carries.
- `fsdp2` runs 2-D parallelism as torchtitan composes it (`bench/_tensor_parallel_peers.py`,
  without its sequence-parallel norms): DTensor's ColwiseParallel / RowwiseParallel on each
  decoder layer over the mesh's "tp" dimension, `fully_shard` over "dp" (sharded as at
  ZeRO-3); embeddings and norms whole.
- `deepspeed` runs DeepSpeed (0.19.8 measured) with `"tensor_parallel": {"autotp_size": T}` at
  ZeRO stages 1-3, torch's AdamW built by DeepSpeed on the split parameters, its comm op
  build skipped as in bench/_deepspeed.py. Skipped, with a note, when it does not import.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._deepspeed import _skip_shm_op_build, deepspeed_missing_reason
from bench._tensor_parallel_peers import (
    deepspeed_config,
    fsdp2_grad_norm,
    fsdp2_state_bytes,
    fsdp2_tensor_parallel,
    max_over_ranks,
    slice_difference,
    whole,
)

LR = 1e-3
MICRO = 2
LENGTH = 16
VOCAB = 96
HIDDEN = 32


def build_llama() -> Any:
    """The tests' tiny Llama (tests/hf_models.py), from the same seed on every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config)


def batch_for(step: int, data_index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 + 100 * step + data_index)
    return torch.randint(3, VOCAB, (MICRO, LENGTH), generator=generator)


@dataclass
class Trace:
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def reference_run(steps: int, data: int) -> tuple[dict[str, torch.Tensor], Trace]:
    model = build_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    trace = Trace()
    for step in range(steps):
        for index in range(data):
            ids = batch_for(step, index)
            loss = model(input_ids=ids, labels=ids).loss
            trace.losses.append(loss.item())
            (loss / data).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        trace.norms.append(torch.nn.utils.get_total_norm(grads).item())
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, trace


def timed_steps(
    steps: int, data_index: int, one_step: Callable[[torch.Tensor], tuple[float, float]]
) -> Trace:
    """`one_step(ids) -> (loss, norm)` each step, timed between barriers."""
    trace = Trace()
    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        loss, norm = one_step(batch_for(step, data_index))
        trace.seconds.append(time.perf_counter() - start)
        trace.losses.append(loss)
        trace.norms.append(norm)
    return trace


@dataclass
class Row:
    engine: str
    stage: int
    weights: float
    losses: float
    norms: float
    seconds: float
    state_bytes: int | None
    note: str = ""


def summarize(
    engine: str, stage: int, trace: Trace, expected: Trace, weights: float, state: int | None
) -> Row:
    """Differences from the reference (losses: this rank's against its data rank's)."""
    data = len(expected.losses) // len(trace.losses)
    index = dist.get_rank() // (dist.get_world_size() // data)
    mine = expected.losses[index::data]
    losses = max(abs(a - b) for a, b in zip(trace.losses, mine, strict=True))
    norms = max(abs(a - b) for a, b in zip(trace.norms, expected.norms, strict=True))
    fastest = min(trace.seconds[1:] or trace.seconds)
    return Row(
        engine,
        stage,
        weights=max_over_ranks(weights),
        losses=max_over_ranks(losses),
        norms=max_over_ranks(norms),
        seconds=max_over_ranks(fastest),
        state_bytes=None if state is None else int(max_over_ranks(float(state))),
    )


def largest_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    missing = set(expected) - set(got)
    if missing:
        raise AssertionError(f"weights missing: {sorted(missing)}")
    return max((got[n].float() - e).abs().max().item() for n, e in expected.items())


def run_zerodp(stage: int, args: Any, reference: dict[str, torch.Tensor], expected: Trace) -> Row:
    import zerodp

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10},
        "tensor_parallel": {"autotp_size": args.tensor},
    }
    engine, _, _, _ = zerodp.initialize(model=build_llama(), config=config)

    def one_step(ids: torch.Tensor) -> tuple[float, float]:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item(), float(engine.get_global_grad_norm())

    trace = timed_steps(args.steps, args.data_index, one_step)
    state = engine.model_state_bytes().total
    weights = largest_difference(engine.state_dict(), reference)
    engine.destroy()
    return summarize("zerodp", stage, trace, expected, weights, state)


def run_fsdp2(args: Any, reference: dict[str, torch.Tensor], expected: Trace) -> Row:
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    model = fsdp2_tensor_parallel(build_llama().to(device), args.data, args.tensor, device)
    # foreach would mix the two meshes' DTensors in one kernel call.
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    state: list[int] = []

    def one_step(ids: torch.Tensor) -> tuple[float, float]:
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = fsdp2_grad_norm(model)
        optimizer.step()
        state[:] = [fsdp2_state_bytes(model, optimizer)]
        optimizer.zero_grad()
        return loss.item(), norm

    trace = timed_steps(args.steps, args.data_index, one_step)
    weights = {n: whole(p.detach()).cpu() for n, p in model.named_parameters()}
    return summarize("fsdp2", 3, trace, expected, largest_difference(weights, reference), state[0])


def run_deepspeed(
    stage: int, args: Any, reference: dict[str, torch.Tensor], expected: Trace
) -> Row:
    import deepspeed

    config = deepspeed_config(stage, MICRO)
    config["tensor_parallel"]["autotp_size"] = args.tensor
    engine, _, _, _ = deepspeed.initialize(
        model=build_llama(),
        config=config,
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
    )

    def one_step(ids: torch.Tensor) -> tuple[float, float]:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item(), float(engine.get_global_grad_norm())

    trace = timed_steps(args.steps, args.data_index, one_step)
    weights, missing = slice_difference(engine, stage, reference, args.tensor)
    row = summarize("deepspeed", stage, trace, expected, weights, None)
    if missing:
        row.note = f"weights not compared: {', '.join(missing)}"
    row.note = "; ".join(filter(None, [row.note, f"train_batch_size {engine.train_batch_size()}"]))
    engine.destroy()
    return row


def merged(first: Row, again: Row) -> Row:
    """Two repeats of one engine: the faster step time, the larger differences."""
    return Row(
        first.engine,
        first.stage,
        weights=max(first.weights, again.weights),
        losses=max(first.losses, again.losses),
        norms=max(first.norms, again.norms),
        seconds=min(first.seconds, again.seconds),
        state_bytes=first.state_bytes,
        note=first.note,
    )


def table(rows: list[Row], header: str) -> str:
    base = {r.stage: r.seconds for r in rows if r.engine == "zerodp"}
    lines = [
        header,
        "",
        "| engine | ZeRO stage | weights vs one process | losses | grad norms | step (ms) "
        "| x zerodp, same stage | model states per rank (bytes) | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r.seconds / base[r.stage]:.2f}" if r.stage in base else "-"
        memory = "-" if r.state_bytes is None else f"{r.state_bytes:,}"
        lines.append(
            f"| {r.engine} | {r.stage} | {r.weights:.1e} | {r.losses:.1e} | {r.norms:.1e} "
            f"| {1000 * r.seconds:.1f} | {ratio} | {memory} | {r.note} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="zerodp,fsdp2,deepspeed")
    args = parser.parse_args()
    engines = args.engines.split(",")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    missing = deepspeed_missing_reason() if "deepspeed" in engines else "not asked for"
    if missing is None:
        import deepspeed

        _skip_shm_op_build()
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    args.data = dist.get_world_size() // args.tensor
    args.data_index = dist.get_rank() // args.tensor
    reference, expected = reference_run(args.steps, args.data)
    rows: list[Row] = []
    for _ in range(args.repeats):
        runs: list[Row] = []
        if "zerodp" in engines:
            runs += [run_zerodp(s, args, reference, expected) for s in args.stages]
        if "fsdp2" in engines:
            runs.append(run_fsdp2(args, reference, expected))
        if missing is None:
            runs += [run_deepspeed(s, args, reference, expected) for s in args.stages]
        rows = runs if not rows else [merged(a, b) for a, b in zip(rows, runs, strict=True)]
    versions = f"torch {torch.__version__}"
    if missing is None:
        versions += f", DeepSpeed {deepspeed.__version__}"
    elif "deepspeed" in engines:
        versions += f", DeepSpeed skipped ({missing})"
    header = (
        f"World {dist.get_world_size()} = T {args.tensor} x D {args.data}, "
        f"{dist.get_backend()}, {args.steps} fp32 AdamW steps, {args.repeats} repeats, {versions}"
    )
    if dist.get_rank() == 0:
        print(table(rows, header))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
