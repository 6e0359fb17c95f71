"""Graph breaks, graphs and recompiles of zerodp under torch.compile, per stage and recipe.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/compile_breaks.py \
        [--stages 0,1,2,3] [--recipes wrapper,in_place,blocks] [--steps 4] [--backend aot_eager]

Recipes (how a user compiles; zerodp.initialize comes after the first and third, before
the second, as a user would write them):

- wrapper: `torch.compile(model)` (the module's own hooks run outside the graph);
- in_place: `model.compile()` (the module's hooks are traced with its forward);
- blocks: `torch.compile(block)` for every transformer block, as torchtitan does with FSDP2;
- config_blocks, config_model: zerodp's `compile` config block, per block or whole model
  (on main before this work the block was accepted with a warning and compiled nothing).

Each cell runs once with fullgraph=False, counting graph breaks, distinct graphs, and
recompiles (a frame compiled again because a guard failed) after the first two steps
(warm-up) and in the steps after (steady state), and once with fullgraph=True (ok, or the
error). Counts are rank 0's, from `torch._dynamo.utils.counters` and a counting wrapper
around dynamo's recompile-reason lookup.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._dynamo import convert_frame  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import zerodp  # noqa: E402
from bench._engines import LossModel  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)
WARMUP_STEPS = 2


class RecompileCounter:
    """Counts the frames dynamo compiles again after a guard failure (with the first reason)."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self._original: Callable[..., Any] = convert_frame.get_and_maybe_log_recompilation_reasons

    def __enter__(self) -> RecompileCounter:
        original = self._original

        def counted(*args: Any, **kwargs: Any) -> Any:
            reasons = original(*args, **kwargs)
            self.reasons.append(str(reasons[0]) if reasons else "unknown")
            return reasons

        convert_frame.get_and_maybe_log_recompilation_reasons = counted
        return self

    def __exit__(self, *exc: object) -> None:
        convert_frame.get_and_maybe_log_recompilation_reasons = self._original


def build(stage: int, recipe: str, args: argparse.Namespace, fullgraph: bool) -> Any:
    torch.manual_seed(0)
    model = LossModel(GPT(args.cfg)).to(default_device())
    options: dict[str, Any] = {"backend": args.backend, "fullgraph": fullgraph}
    if recipe == "wrapper":
        model = torch.compile(model, **options)  # type: ignore[assignment]
    elif recipe == "blocks":
        blocks = model.gpt.blocks
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, **options)  # type: ignore[assignment]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if recipe.startswith("config_"):  # zerodp's compile block: per block, or the whole model
        config["compile"] = {
            "enabled": True,
            "backend": args.backend,
            "kwargs": {"fullgraph": fullgraph},
            "per_block": recipe == "config_blocks",
        }
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    if recipe == "in_place":
        engine.module.compile(**options)
    return engine


def snapshot(recompiles: RecompileCounter) -> tuple[int, int, int]:
    return (
        sum(counters["graph_break"].values()),
        int(counters["stats"]["unique_graphs"]),
        len(recompiles.reasons),
    )


def run_cell(stage: int, recipe: str, args: argparse.Namespace, fullgraph: bool) -> dict[str, Any]:
    torch._dynamo.reset()
    counters.clear()
    engine = build(stage, recipe, args, fullgraph)
    cfg = args.cfg
    generator = torch.Generator().manual_seed(dist.get_rank())
    result: dict[str, Any] = {}
    try:
        with RecompileCounter() as recompiles:
            for step in range(args.steps):
                tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=generator)
                tokens = tokens.to(default_device())
                engine.backward(engine(tokens, tokens))
                engine.step()
                if step + 1 == WARMUP_STEPS:
                    result["warm"] = snapshot(recompiles)
            result["end"] = snapshot(recompiles)
            result["reasons"] = dict(counters["graph_break"])
            result["recompile_reasons"] = list(recompiles.reasons)
    except Exception as error:  # the table reports what failed
        result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    finally:
        engine.destroy()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--recipes", default="wrapper,in_place,blocks")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reasons", action="store_true", help="print the break reasons")
    args = parser.parse_args(argv)
    args.cfg = dataclasses.replace(CFG, n_layer=args.layers)
    ensure_process_group()
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        for recipe in args.recipes.split(","):
            free = run_cell(stage, recipe, args, fullgraph=False)
            strict = run_cell(stage, recipe, args, fullgraph=True)
            rows.append((stage, recipe, free, strict))
            if dist.get_rank() == 0 and args.reasons:
                for reason, count in free.get("reasons", {}).items():
                    print(f"  stage {stage} {recipe}: {count} x {reason[:160]!r}", flush=True)
                for reason in free.get("recompile_reasons", [])[:3]:
                    print(f"  stage {stage} {recipe} recompile: {reason[:160]!r}", flush=True)
    if dist.get_rank() == 0:
        print(
            f"backend {args.backend}, {args.steps} steps, GPT {args.cfg.n_layer} layers; "
            f"warm-up = first {WARMUP_STEPS} steps"
        )
        header = "stage recipe        breaks graphs recompiles(warm-up/steady) fullgraph=True"
        print(header)
        for stage, recipe, free, strict in rows:
            if "error" in free:
                cells = f"error: {free['error']}"
            else:
                (_, _, warm_re), (breaks, graphs, end_re) = free["warm"], free["end"]
                cells = f"{breaks:6d} {graphs:6d} {warm_re:12d}/{end_re - warm_re:<12d}"
            strict_cell = strict.get("error", "ok")
            print(f"{stage:5d} {recipe:13s} {cells} {strict_cell}")
    destroy_process_group_if_owned()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
