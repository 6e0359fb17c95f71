"""Optimizers that read whole tensors: step time, traffic, placement, and distance from one process.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 \
        bench/optimizers.py [--steps N] [--repeats R] [--json out.json]

One seeded decoder (embeddings and an untied `lm_head`, so DeepSpeed's Muon rule
leaves both on Adam) trained on the same per-rank token batches by:

1. zerodp at stages 0-3 with AdamW, with the config's "Muon" (torch's Muon on
   the matrices, AdamW on the rest) and with torch's Adafactor: the median step
   time of each, timed interleaved, as a ratio to AdamW at the same stage;
2. the traffic of one step (bytes of `engine.comm.stats`, summed over ranks),
   the tensor-wise all-to-alls against the plan's own count, and the two
   owner placements ("holders": only straddling tensors move; "balanced": any
   rank owns any tensor) with the update cost of the busiest rank over the
   mean;
3. the distance from the same optimizer run in one process on the global
   batches after `--distance-steps` steps (max |w - w_ref| and the share of the
   update that is off, |w - w_ref| / |w_ref - w_0|), for zerodp's "Muon" at
   stages 0-3 and, when DeepSpeed imports, DeepSpeed's "Muon" at stages 1-3,
   each with 1 and 2 micro-batches per step. Two references: torch's Muon +
   AdamW (what zerodp runs), and DeepSpeed's own single-process Muon
   (`SingleDeviceMuonWithAuxAdam`, the same Newton-Schulz variant as its ZeRO
   path), so that an engine's distance from its own algorithm shows what ZeRO
   did to it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import zerodp  # noqa: E402
from bench._deepspeed import _skip_shm_op_build, deepspeed_missing_reason  # noqa: E402
from zerodp.comm import destroy_process_group_if_owned, ensure_process_group  # noqa: E402
from zerodp.optim.muon_config import uses_muon  # noqa: E402

MUON = {"lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01}
ADAFACTOR_LR = 1e-2
ADAMW_LR = 3e-3
MICRO_BATCH = 4  # sequences per rank per optimizer step (split in two with accumulation 2)


class Decoder(nn.Module):
    """Pre-norm blocks of attention and MLP, an embedding and an untied output head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(dim),
                    "qkv": nn.Linear(dim, 3 * dim, bias=False),
                    "out": nn.Linear(dim, dim, bias=False),
                    "norm2": nn.LayerNorm(dim),
                    "up": nn.Linear(dim, 4 * dim),
                    "down": nn.Linear(4 * dim, dim),
                }
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        batch, seq, dim = x.shape
        for layer in self.layers:
            q, k, v = layer["qkv"](layer["norm1"](x)).split(dim, dim=2)
            shape = (batch, seq, self.heads, dim // self.heads)
            q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + layer["out"](y.transpose(1, 2).reshape(batch, seq, dim))
            x = x + layer["down"](F.gelu(layer["up"](layer["norm2"](x))))
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    p.add_argument("--distance-steps", type=int, default=4)
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--json", metavar="PATH")
    p.add_argument(
        "--sections", default="time,traffic,distance", help="which of time, traffic, distance"
    )
    return p.parse_args()


def rank0_print(*args: Any) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def batch(args: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9_000 + 100 * step + rank)
    data = torch.randint(args.vocab, (MICRO_BATCH, args.seq + 1), generator=gen)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def global_batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(args, step, rank) for rank in range(dist.get_world_size())]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


# -- zerodp engines -------------------------------------------------------------------------


def zerodp_engine(model: nn.Module, stage: int, kind: str, gas: int = 1, **zero: Any) -> Any:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH // gas,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    optimizer: Any = None
    if kind == "AdamW":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": ADAMW_LR, "weight_decay": 0.01}}
    elif kind == "Muon":
        config["optimizer"] = {"type": "Muon", "params": dict(MUON)}
    else:
        optimizer = torch.optim.Adafactor(model.parameters(), lr=ADAFACTOR_LR)
    engine, _, _, _ = zerodp.initialize(model=model, config=config, optimizer=optimizer)
    return engine


def train_step(engine: Any, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    engine.backward(engine(*data))
    engine.step()


def _time(
    engines: dict[str, Any], args: argparse.Namespace
) -> dict[str, tuple[float, float, float]]:
    """Per engine, timed interleaved: the median whole step, the median engine.step() alone,
    and the fastest whole step (the least disturbed by other work on a shared machine)."""
    rank = dist.get_rank()
    samples: dict[str, list[float]] = {k: [] for k in engines}
    step_only: dict[str, list[float]] = {k: [] for k in engines}
    for engine in engines.values():  # warm up
        train_step(engine, batch(args, 0, rank))
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            dist.barrier()
            start, in_step = time.perf_counter(), 0.0
            for step in range(args.steps):
                data = batch(args, 1 + repeat * args.steps + step, rank)
                engine.backward(engine(*data))
                t0 = time.perf_counter()
                engine.step()
                in_step += time.perf_counter() - t0
            dist.barrier()
            samples[name].append((time.perf_counter() - start) / args.steps)
            step_only[name].append(in_step / args.steps)
    return {
        k: (statistics.median(samples[k]), statistics.median(step_only[k]), min(samples[k]))
        for k in engines
    }


def step_times(
    args: argparse.Namespace, base: nn.Module, with_deepspeed: bool
) -> list[dict[str, Any]]:
    rows = []
    for stage in range(4):
        engines = {
            k: zerodp_engine(copy.deepcopy(base), stage, k) for k in ("AdamW", "Muon", "Adafactor")
        }
        if with_deepspeed and stage > 0:
            engines["DeepSpeed AdamW"] = deepspeed_engine(copy.deepcopy(base), stage, 1, "AdamW")
            engines["DeepSpeed Muon"] = deepspeed_engine(copy.deepcopy(base), stage, 1, "Muon")
        times = _time(engines, args)
        for name, (whole, in_step, fastest) in times.items():
            own_adamw = "DeepSpeed AdamW" if name.startswith("DeepSpeed") else "AdamW"
            rows.append(
                {
                    "stage": stage,
                    "optimizer": name,
                    "step_s": whole,
                    "optimizer_step_s": in_step,
                    "ratio_to_adamw": whole / times[own_adamw][0],
                    "min_ratio_to_adamw": fastest / times[own_adamw][2],
                }
            )
        for engine in engines.values():
            engine.destroy()
    return rows


# -- traffic and placement -------------------------------------------------------------------


def traffic(args: argparse.Namespace, base: nn.Module) -> list[dict[str, Any]]:
    rows = []
    rank = dist.get_rank()
    for stage in (1, 2, 3):
        for kind in ("AdamW", "Muon", "Adafactor"):
            for placement in ("holders", "balanced") if kind != "AdamW" else ("-",):
                zero = {} if placement == "-" else {"tensorwise_placement": placement}
                engine = zerodp_engine(copy.deepcopy(base), stage, kind, **zero)
                train_step(engine, batch(args, 0, rank))
                engine.comm.stats.reset()
                train_step(engine, batch(args, 1, rank))
                snapshot = engine.comm.stats.snapshot()
                totals = torch.tensor(
                    [engine.comm.stats.total_bytes(), snapshot["all_to_all"]["bytes"]],
                    dtype=torch.float64,
                )
                dist.all_reduce(totals)
                in_step = []
                for step in range(2, 2 + args.repeats):
                    engine.backward(engine(*batch(args, step, rank)))
                    dist.barrier()
                    start = time.perf_counter()
                    engine.step()
                    in_step.append(time.perf_counter() - start)
                whole = engine.optimizer.torch_optimizers.tensorwise
                planned, balance = 0, 1.0
                if whole is not None:
                    plan = whole.plan
                    planned = (plan.elements_in() + plan.elements_out()) * 4
                    costs = plan.cost_by_rank()
                    balance = max(costs) / (sum(costs) / len(costs)) if sum(costs) else 1.0
                rows.append(
                    {
                        "stage": stage,
                        "optimizer": kind,
                        "placement": placement,
                        "bytes": int(totals[0]),
                        "all_to_all_bytes": int(totals[1]),
                        "planned_bytes": planned,
                        "busiest_over_mean": balance,
                        "optimizer_step_s": statistics.median(in_step),
                        "tensors_moved": 0
                        if whole is None
                        else sum(1 for t in whole.plan.tasks if t.remote_fragments()),
                    }
                )
                engine.destroy()
    return rows


# -- distance from one process --------------------------------------------------------------


def reference_torch(params: list[tuple[str, nn.Parameter]]) -> Callable[[], None]:
    muon = [p for n, p in params if uses_muon(n, p)]
    rest = [p for n, p in params if not uses_muon(n, p)]
    optimizers = [
        torch.optim.Muon(muon, lr=MUON["lr"], weight_decay=MUON["weight_decay"]),
        torch.optim.AdamW(
            rest,
            lr=MUON["adam_lr"],
            weight_decay=MUON["weight_decay"],
            betas=(0.9, 0.95),
            eps=1e-10,
        ),
    ]

    def step() -> None:
        for optimizer in optimizers:
            optimizer.step()

    return step


def reference_deepspeed(params: list[tuple[str, nn.Parameter]]) -> Callable[[], None]:
    from deepspeed.runtime.zero.muon.original_muon import SingleDeviceMuonWithAuxAdam

    muon = [p for n, p in params if uses_muon(n, p)]
    rest = [p for n, p in params if not uses_muon(n, p)]
    optimizer = SingleDeviceMuonWithAuxAdam(
        [
            {
                "params": muon,
                "use_muon": True,
                "lr": MUON["lr"],
                "weight_decay": MUON["weight_decay"],
            },
            {
                "params": rest,
                "use_muon": False,
                "lr": MUON["adam_lr"],
                "weight_decay": MUON["weight_decay"],
            },
        ]
    )
    return optimizer.step


def one_process(
    args: argparse.Namespace,
    base: nn.Module,
    make: Callable[..., Callable[[], None]],
    chunked: bool = False,
) -> list[torch.Tensor]:
    """The optimizer in one process on each step's global batch; `chunked`: the same batch as
    per-rank chunks whose gradients add up (the same sum in another order)."""
    model = copy.deepcopy(base)
    step = make(list(model.named_parameters()))
    world = dist.get_world_size()
    for index in range(args.distance_steps):
        model.zero_grad(set_to_none=True)
        if chunked:
            for rank in range(world):
                (model(*batch(args, 100 + index, rank)) / world).backward()
        else:
            model(*global_batch(args, 100 + index)).backward()
        step()
    return [p.detach().clone() for p in model.parameters()]


def deepspeed_engine(model: nn.Module, stage: int, gas: int, kind: str = "Muon") -> Any:
    """DeepSpeed as its users configure Muon; AdamW as a torch optimizer (no kernel build)."""
    import deepspeed

    _skip_shm_op_build()
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    optimizer = None
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH // gas,
        "gradient_accumulation_steps": gas,
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
    }
    if kind == "Muon":
        config["optimizer"] = {"type": "Muon", "params": dict(MUON)}
        if stage == 3:
            zero["reduce_scatter"] = False  # DeepSpeed refuses Muon with it
    else:
        config["zero_allow_untested_optimizer"] = True
        optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=config, optimizer=optimizer, model_parameters=model.parameters()
    )
    return engine


def trained(
    args: argparse.Namespace, base: nn.Module, engine_kind: str, stage: int, gas: int
) -> list[torch.Tensor]:
    """Weights after `--distance-steps` optimizer steps, each on the step's global batch."""
    model = copy.deepcopy(base)
    rank = dist.get_rank()
    if engine_kind == "zerodp":
        engine = zerodp_engine(model, stage, "Muon", gas=gas)
        full = zerodp.utils.safe_get_full_fp32_param
    else:
        engine = deepspeed_engine(model, stage, gas)
        from deepspeed.utils import safe_get_full_fp32_param as full
    per_micro = MICRO_BATCH // gas
    for index in range(args.distance_steps):
        tokens, targets = batch(args, 100 + index, rank)
        for micro in range(gas):
            part = slice(micro * per_micro, (micro + 1) * per_micro)
            engine.backward(engine(tokens[part], targets[part]))
            engine.step()
    weights = [full(p).detach().clone().cpu() for p in engine.module.parameters()]
    engine.destroy()
    return weights


def _norm_over(
    tensors: list[torch.Tensor], others: list[torch.Tensor], index: range | list[int]
) -> float:
    """The 2-norm of `tensors - others` over the tensors at `index`, taken as one vector."""
    return math.sqrt(sum((tensors[i] - others[i]).square().sum().item() for i in index))


def distance(
    weights: list[torch.Tensor], ref: list[torch.Tensor], start: list[torch.Tensor]
) -> tuple[float, float]:
    worst = max((w - r).abs().max().item() for w, r in zip(weights, ref, strict=True))
    every = range(len(ref))
    return worst, _norm_over(weights, ref, every) / _norm_over(ref, start, every)


def by_optimizer(
    weights: list[torch.Tensor],
    ref: list[torch.Tensor],
    start: list[torch.Tensor],
    muon: list[int],
    rest: list[int],
) -> dict[str, float]:
    """The Muon-stepped matrices' move as a share of the reference's move
    (|w - w_0| / |w_ref - w_0| over those matrices: 1 when they move as far as they
    should), and the Adam-stepped parameters' share of the update that is off."""
    return {
        "muon_moved": _norm_over(weights, start, muon) / _norm_over(ref, start, muon),
        "adam_off": _norm_over(weights, ref, rest) / _norm_over(ref, start, rest),
    }


def distances(
    args: argparse.Namespace, base: nn.Module, with_deepspeed: bool
) -> list[dict[str, Any]]:
    start = [p.detach().clone() for p in base.parameters()]
    named = list(base.named_parameters())
    muon = [i for i, (name, param) in enumerate(named) if uses_muon(name, param)]
    rest = [i for i in range(len(named)) if i not in muon]
    refs = {"torch": one_process(args, base, reference_torch)}
    if with_deepspeed:
        refs["deepspeed"] = one_process(args, base, reference_deepspeed)
    runs = [("zerodp", s) for s in range(4)] + (
        [("deepspeed", s) for s in (1, 2, 3)] if with_deepspeed else []
    )
    rows = []
    for name, make in (("torch", reference_torch), ("deepspeed", reference_deepspeed)):
        if name in refs:
            floor = one_process(args, base, make, chunked=True)
            row: dict[str, Any] = {"engine": f"one process ({name}), batch in rank chunks"}
            row["max_" + name], row["share_" + name] = distance(floor, refs[name], start)
            rows.append(row)
    for engine_kind, stage in runs:
        for gas in (1, 2):
            try:
                weights = trained(args, base, engine_kind, stage, gas)
            except Exception as error:  # a failure is a result too (reported, not fatal)
                rows.append(
                    {
                        "engine": engine_kind,
                        "stage": stage,
                        "gas": gas,
                        "error": f"{type(error).__name__}: {error}"[:160],
                    }
                )
                continue
            row = {"engine": engine_kind, "stage": stage, "gas": gas}
            for name, ref in refs.items():
                row[f"max_{name}"], row[f"share_{name}"] = distance(weights, ref, start)
                parts = by_optimizer(weights, ref, start, muon, rest)
                row |= {f"{part}_{name}": value for part, value in parts.items()}
            rows.append(row)
    return rows


# -- report ---------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    ensure_process_group()
    torch.manual_seed(0)
    base = Decoder(args.vocab, args.dim, args.layers, heads=4)
    numel = sum(p.numel() for p in base.parameters())
    missing = "--no-deepspeed" if args.no_deepspeed else deepspeed_missing_reason()
    with_ds = missing is None
    out = rank0_print
    out(f"# {numel:,} parameters, world size {dist.get_world_size()}, fp32, CPU")
    if not with_ds:
        out(f"DeepSpeed not run: {missing}")
    results: dict[str, Any] = {"params": numel, "world_size": dist.get_world_size()}

    sections = set(args.sections.split(","))
    if "time" in sections:
        report_times(results, step_times(args, base, with_ds))
    if "traffic" in sections:
        report_traffic(results, traffic(args, base))
    if "distance" in sections:
        report_distances(results, distances(args, base, with_ds), args)
    if args.json and dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps(results, indent=1))
    destroy_process_group_if_owned()


def report_times(results: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    results["step_time"] = rows
    out = rank0_print
    out("\n## step time: median s per step, engine.step() alone, and the ratio to AdamW")
    out(
        "| stage | optimizer | step s | engine.step() s | / AdamW of the same engine "
        "(medians; fastest steps) |"
    )
    out("|---|---|---|---|---|")
    for r in results["step_time"]:
        out(
            f"| {r['stage']} | {r['optimizer']} | {r['step_s']:.3f} | "
            f"{r['optimizer_step_s']:.3f} | {r['ratio_to_adamw']:.2f}x; "
            f"{r['min_ratio_to_adamw']:.2f}x |"
        )


def report_traffic(results: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    results["traffic"] = rows
    out = rank0_print
    out("\n## traffic of one step (bytes over all ranks) and owner placement")
    out(
        "| stage | optimizer | placement | bytes | / AdamW | all-to-all | plan | "
        "tensors moved | busiest rank's update cost / mean | engine.step() s |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|")
    adamw = {r["stage"]: r["bytes"] for r in results["traffic"] if r["optimizer"] == "AdamW"}
    for r in results["traffic"]:
        out(
            f"| {r['stage']} | {r['optimizer']} | {r['placement']} | {r['bytes']:,} | "
            f"{r['bytes'] / adamw[r['stage']]:.3f}x | {r['all_to_all_bytes']:,} | "
            f"{r['planned_bytes']:,} | {r['tensors_moved']} | {r['busiest_over_mean']:.2f} | "
            f"{r['optimizer_step_s']:.3f} |"
        )


def report_distances(
    results: dict[str, Any], rows: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    results["distance"] = rows
    out = rank0_print
    out(
        f"\n## distance from one process after {args.distance_steps} steps: "
        "max |w - w_ref| (share of the update off: |w - w_ref| / |w_ref - w_0|)"
    )
    out("| run | stage | micro-batches | vs torch Muon + AdamW | vs DeepSpeed's one-process Muon |")
    out("|---|---|---|---|---|")
    for r in results["distance"]:
        if "error" in r:
            out(f"| {r['engine']} | {r['stage']} | {r['gas']} | failed: {r['error']} | |")
            continue
        cells = [
            f"{r['max_' + n]:.2e} ({r['share_' + n]:.1%})" if "max_" + n in r else "-"
            for n in ("torch", "deepspeed")
        ]
        where = f"{r.get('stage', '-')} | {r.get('gas', '-')}"
        out(f"| {r['engine']} | {where} | {cells[0]} | {cells[1]} |")
    out(
        "\nBy optimizer: the Muon matrices' move as a share of the reference's "
        "(|w - w_0| / |w_ref - w_0|; 100% is as far as they should), and the Adam-stepped "
        "parameters' share of the update that is off"
    )
    out("| run | stage | micro-batches | vs torch Muon + AdamW | vs DeepSpeed's one-process Muon |")
    out("|---|---|---|---|---|")
    for r in results["distance"]:
        if "error" in r or "gas" not in r:
            continue
        cells = [
            f"Muon moved {r['muon_moved_' + n]:.1%}, Adam off {r['adam_off_' + n]:.1%}"
            if "muon_moved_" + n in r
            else "-"
            for n in ("torch", "deepspeed")
        ]
        out(f"| {r['engine']} | {r['stage']} | {r['gas']} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
