"""Expert parallelism side by side: zerodp stage 3 without and with EP, DeepSpeed's AutoEP.

    python bench/expert_parallel.py [--worlds 2,4] [--steps 6] [--timed-steps 12] \\
        [--budget-mib 256] [--json bench/results/expert_parallel.json] [--plots bench/results]
    python bench/expert_parallel.py --from-json bench/results/expert_parallel.json

Backs the "Side by side" section of docs/expert-parallel.md. One run, CPU and gloo, every
job in fresh processes (bench/_expert_parallel_worker.py, started as bench/scaling.py
starts its jobs), on a Hugging Face Qwen3-MoE built from a config with the proportions of
Qwen3-30B-A3B scaled down (bench/_expert_parallel_model.py: 4 layers, hidden 128, 32
experts of width 64, top-2; 3.6 M parameters, 87% of them experts).

Part 1, at each world size W (`--worlds`), every engine from the same weights on the same
batches (each rank its own 4 rows of 64 tokens per step), stepped in turn, `--steps` steps
with AdamW and again with SGD (fp32, gradients clipped at a global norm of 1):

- `plain`: ideal data parallelism (a model copy per rank, gradients all-reduced): the
  round-off floor;
- `zerodp`: zerodp ZeRO stage 3 without expert parallelism;
- `zerodp-epE`: zerodp stage 3 with `"expert_parallel": {"enabled": true, "autoep_size":
  E}`, E = W (and E = 2 at W = 4, with `--extra-ep`: experts sharded over 2 expert-data
  ranks);
- `autoep-epE`: DeepSpeed 0.19.8 stage 3 with AutoEP (`"preset_model": "qwen3_moe"`),
  E = W; tried as it ships first, and when it does not start the error is reported and the
  bench's in-process patch applied (`patch_autoep_output_recorders`).

Per engine: model-state bytes per rank (parameters, gradients, optimizer state as held
after the last step, and the experts' part of them; bench/_expert_traffic.py), the bytes
of one step by purpose (gathers of expert elements, other gathers, gradient reductions,
token all-to-alls; the median over the timed steps, the rank with most), the most
parameter bytes gathered at once (zerodp), the median step time after `--warmup` steps
(the slowest rank's), and against one process on the same data: the largest weight
difference after the last step, the largest loss difference, and how many tokens x
layers were routed to other experts than in one process.

Part 2, "experts per byte": for zerodp without and with EP (E = W) and AutoEP, the most
experts per layer that train two AdamW steps when each rank may hold `--budget-mib` of
private memory beyond what it held before the model was built (RLIMIT_DATA), the
model, the engine and the steps included. Doubling from `--start`, then bisection down
to `--fit-step` experts (each attempt fresh processes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench._expert_parallel_model import MODEL, build_model, parameter_counts  # noqa: E402
from bench._expert_parallel_report import fit_table, plot, side_by_side_table  # noqa: E402
from bench._scaling_launch import deepspeed_python, launch, rank_results  # noqa: E402

MiB = 1 << 20
WORKER = _ROOT / "bench" / "_expert_parallel_worker.py"
_START = time.perf_counter()


def progress(message: str) -> None:
    print(f"[expert_parallel {time.perf_counter() - _START:5.0f}s] {message}", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", default="2,4", help="world sizes (E = W for EP)")
    p.add_argument("--steps", type=int, default=6, help="steps per optimizer, weights checked")
    p.add_argument("--timed-steps", type=int, default=12, help="AdamW steps timed")
    p.add_argument("--warmup", type=int, default=2, help="timed steps left out of the times")
    p.add_argument(
        "--no-extra-ep",
        dest="extra_ep",
        action="store_false",
        help="leave out zerodp at E = 2 on 4 ranks",
    )
    p.add_argument("--no-deepspeed", dest="deepspeed", action="store_false")
    p.add_argument("--parts", default="compare,fit")
    p.add_argument("--budget-mib", type=float, default=256.0, help="fit: memory per rank")
    p.add_argument("--start", type=int, default=32, help="fit: experts tried first")
    p.add_argument("--fit-step", type=int, default=4, help="fit: resolution, in experts")
    p.add_argument("--limit", type=int, default=1024, help="fit: most experts tried")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per job")
    p.add_argument("--json", metavar="PATH", help="write everything measured as JSON")
    p.add_argument("--plots", default="bench/results", metavar="DIR")
    p.add_argument("--from-json", metavar="PATH", help="run nothing: report an earlier --json")
    return p.parse_args(argv)


def engines_for(world: int, args: argparse.Namespace) -> list[str]:
    engines = ["plain", "zerodp", f"zerodp-ep{world}"]
    if args.extra_ep and world > 2 and world % 2 == 0:
        engines.append("zerodp-ep2")
    if args.deepspeed:
        engines.append(f"autoep-ep{world}")
    return engines


def _over_ranks(results: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """Each engine's row per pass: the rank with most bytes, the largest differences."""
    rows = []
    for index, first in enumerate(results[0]["runs"]):
        runs = [r["runs"][index] for r in results]
        traffic = {  # per kind: the median over the timed steps, on the rank with most
            key: max(statistics.median(t[key] for t in run["traffic"][warmup:]) for run in runs)
            for key in first["traffic"][0]
        }
        peaks = [run["peak_gathered_bytes"] for run in runs]
        rerouted = [sum(run["rerouted"][s] for run in runs) for s in range(len(first["losses"]))]
        by_step = [
            max(run["weights_by_step"][s] for run in runs)
            for s in range(len(first["weights_by_step"]))
        ]
        alike = next((s for s, n in enumerate(rerouted) if n), len(rerouted))
        rows.append(
            {
                "pass": first["pass"],
                "engine": first["engine"],
                "optimizer": first["optimizer"],
                "median_s": first["median_s"],
                "min_s": first["min_s"],
                "seconds": first["seconds"],
                "state_bytes": max(run["state_bytes"] for run in runs),
                "expert_state_bytes": max(run["expert_state_bytes"] for run in runs),
                "peak_gathered_bytes": None if None in peaks else max(peaks),
                "traffic": {k: int(v) for k, v in traffic.items()},
                "weights": max(run["weights"] for run in runs),
                "weights_by_step": by_step,
                "weights_while_routed_alike": max(by_step[:alike]) if by_step[:alike] else None,
                "loss_difference": max(max(run["losses"]) for run in runs),
                "rerouted_by_step": rerouted,
                "rerouted": sum(rerouted),
                "routed": sum(run["routed"] for run in runs),
                "first_rerouted_step": None if alike == len(rerouted) else alike,
            }
        )
    return rows


def compare(world: int, args: argparse.Namespace) -> dict[str, Any]:
    engines = engines_for(world, args)
    task = {
        "kind": "compare",
        "world": world,
        "engines": engines,
        "model": MODEL,
        "warmup": args.warmup,
        "passes": [
            {"name": "exact", "optimizer": name, "steps": args.steps, "check_each_step": True}
            for name in ("adamw", "sgd")
        ]
        + [
            {
                "name": "timed",
                "optimizer": "adamw",
                "steps": args.timed_steps,
                "check_each_step": False,
            }
        ],
    }
    progress(f"W={world}: {', '.join(engines)}")
    codes, out_path = launch(task, world, args.python, args.timeout_s, worker=WORKER)
    results = [r for r in rank_results(out_path, world) if r is not None]
    if any(c != 0 for c in codes) or len(results) != world:
        raise SystemExit(f"the W={world} comparison failed (exit codes {codes}); see above")
    return {
        "world": world,
        "autoep": results[0]["autoep"],
        "rows": _over_ranks(results, args.warmup),
    }


def fit_attempt(args: argparse.Namespace, engine: str, world: int, experts: int) -> dict[str, Any]:
    task = {
        "kind": "fit",
        "engine": engine,
        "model": MODEL | {"experts": experts},
        "budget_bytes": int(args.budget_mib * MiB),
    }
    started = time.perf_counter()
    codes, out_path = launch(task, world, args.python, args.timeout_s, worker=WORKER)
    results = rank_results(out_path, world)
    ok = all(c == 0 for c in codes) and all(r is not None and r["ok"] for r in results)
    errors = sorted({r["error"] for r in results if r is not None and "error" in r})
    record = {
        "experts": experts,
        "ok": ok,
        "errors": errors,
        "vmhwm_bytes": max((r["vmhwm_bytes"] for r in results if r), default=0),
        "before_vmdata_bytes": max((r["before_vmdata_bytes"] for r in results if r), default=0),
        "before_vmhwm_bytes": max((r["before_vmhwm_bytes"] for r in results if r), default=0),
        "phases_vmhwm_bytes": results[0]["phases_vmhwm_bytes"] if results[0] else {},
        "state_bytes": max((r.get("state_bytes", 0) for r in results if r), default=0),
        "seconds": round(time.perf_counter() - started, 1),
    }
    progress(f"fit {engine} W={world} N={experts}: {'fits' if ok else 'fails'} {errors}")
    return record


def fit_search(args: argparse.Namespace, engine: str, world: int) -> dict[str, Any]:
    """Doubling from --start, then bisection to --fit-step: the most experts that fit."""
    step = args.fit_step
    attempts: list[dict[str, Any]] = []

    def fits(experts: int) -> bool:
        attempts.append(fit_attempt(args, engine, world, experts))
        return bool(attempts[-1]["ok"])

    lo, hi, experts = 0, None, args.start
    while experts <= args.limit:
        if not fits(experts):
            hi = experts
            break
        lo, experts = experts, experts * 2
    while hi is not None and hi - lo > step:
        middle = (lo + hi) // 2 // step * step
        if middle <= lo:
            break
        if fits(middle):
            lo = middle
        else:
            hi = middle
    return {
        "engine": engine,
        "world": world,
        "most_experts": lo,
        "capped": hi is None,
        "attempts": attempts,
    }


def fit(args: argparse.Namespace, worlds: list[int]) -> list[dict[str, Any]]:
    results = []
    for world in worlds:
        engines = ["zerodp", f"zerodp-ep{world}"]
        if args.deepspeed:
            engines.append(f"autoep-ep{world}")
        for engine in engines:
            results.append(fit_search(args, engine, world))
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    worlds = [int(w) for w in args.worlds.split(",")]
    args.python = sys.executable
    if args.deepspeed and deepspeed_python(args.python) is None:
        progress("DeepSpeed does not import here; its rows are left out")
        args.deepspeed = False
    params, experts = parameter_counts(build_model(MODEL))
    saved: dict[str, Any] = {
        "model": MODEL,
        "params": params,
        "expert_params": experts,
        "steps": args.steps,
        "timed_steps": args.timed_steps,
        "warmup": args.warmup,
        "budget_mib": args.budget_mib,
        "versions": _versions(torch.__version__, args.deepspeed),
    }
    parts = args.parts.split(",")
    load = [os.getloadavg()[0]]  # the machine's load: context for the step times
    if "compare" in parts:
        saved["compare"] = [compare(world, args) for world in worlds]
        load.append(os.getloadavg()[0])
    if "fit" in parts:
        saved["fit"] = fit(args, worlds)
    saved["load_average"] = load
    return saved


def _versions(torch_version: str, with_deepspeed: bool) -> dict[str, str]:
    import transformers

    versions = {"torch": torch_version, "transformers": transformers.__version__}
    if with_deepspeed:
        from importlib.metadata import version

        versions["deepspeed"] = version("deepspeed")
    return versions


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
    else:
        saved = run(args)
        if args.json:
            Path(args.json).write_text(json.dumps(saved, indent=1))
    print(side_by_side_table(saved))
    if saved.get("fit"):
        print()
        print(fit_table(saved))
    path = plot(saved, args.plots)
    if path is not None:
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
