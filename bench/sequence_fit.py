"""The longest sequence that trains under a fixed memory budget per rank.

    python bench/sequence_fit.py [--sizes 1,2,4] [--budget-mib 16] [--json PATH] [--plots DIR]
    python bench/sequence_fit.py --from-json bench/results/sequence_fit.json

For zerodp with `sequence_parallel_size` S = 1, 2, 4 (the world size: one sequence split
over every rank), without and with `tiled_compute` (MLPs and logits + loss), and
DeepSpeed 0.19.8's Ulysses at the same S (untiled; where `--ds-python` imports it): the
longest sequence of one row that trains two ZeRO stage 3 steps (AdamW) when each rank may
hold `--budget-mib` of private memory beyond what it holds once the engine is built and
has trained one step on 8 x S tokens (RLIMIT_DATA; bench/_sequence_fit_worker.py): the
model states are outside the budget, what a longer sequence adds is inside it. The
length is searched by doubling, then bisection down to `--resolution` (each attempt fresh
processes, as bench/scaling.py's `fit` sweep does); lengths are multiples of 8 x S.

The model: a tiny Llama (vocabulary 4096, hidden 64, MLP 256, 2 layers, 4 heads; 0.66 M
parameters, untied output layer), whose per-token cost is dominated by the logits, as
a real model's is at long sequences (vocabulary 32-256 K against hidden 4-8 K).

Printed: the table of the longest lengths, and per configuration the activation bytes
per token per rank (the slope of the peak resident memory of the attempts that fit
against the tokens each rank holds) and what the budget leaves for everything else
(budget - slope x tokens per rank at the longest length): the two numbers
docs/sequence-parallel.md scales to 8 GPUs with. The plot goes to --plots.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench._scaling_launch import deepspeed_python, launch, rank_results  # noqa: E402

MiB = 1 << 20
MODEL = {"vocab": 4096, "hidden": 64, "intermediate": 256, "layers": 2, "heads": 4}
WORKER = _ROOT / "bench" / "_sequence_fit_worker.py"
_START = time.perf_counter()


def progress(message: str) -> None:
    print(f"[sequence_fit {time.perf_counter() - _START:5.0f}s] {message}", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="1,2,4", help="sequence_parallel_size values (world sizes)")
    p.add_argument(
        "--budget-mib", type=float, default=16.0, help="memory per rank beyond the model"
    )
    p.add_argument("--engines", default="zerodp,zerodp-tiled,deepspeed")
    p.add_argument("--ds-python", default=sys.executable, help="an interpreter importing deepspeed")
    p.add_argument("--start", type=int, default=128, help="first length tried, per rank")
    p.add_argument("--limit", type=int, default=65536, help="longest length tried")
    p.add_argument("--resolution", type=float, default=1.1, help="stop when hi / lo is below")
    p.add_argument("--timeout-s", type=float, default=240.0, help="per attempt")
    p.add_argument("--json", metavar="PATH", help="write the attempts and results as JSON")
    p.add_argument("--plots", default="bench/results", metavar="DIR")
    p.add_argument("--from-json", metavar="PATH", help="run nothing: report an earlier --json")
    return p.parse_args(argv)


def attempt(args: argparse.Namespace, engine: str, size: int, length: int) -> dict[str, Any]:
    task = {
        "engine": "deepspeed" if engine == "deepspeed" else "zerodp",
        "tiled": engine == "zerodp-tiled",
        "sequence": size,
        "length": length,
        "budget_bytes": int(args.budget_mib * MiB),
        "model": MODEL,
    }
    python = args.ds_python if engine == "deepspeed" else sys.executable
    started = time.perf_counter()
    codes, out_path = launch(task, size, python, args.timeout_s, worker=WORKER)
    results = rank_results(out_path, size)
    ok = all(c == 0 for c in codes) and all(r is not None and r["ok"] for r in results)
    errors = sorted({r["error"] for r in results if r is not None and "error" in r})
    hwm = max((r["vmhwm_bytes"] for r in results if r is not None), default=0)
    record = {"length": length, "ok": ok, "errors": errors, "vmhwm_bytes": hwm}
    record["seconds"] = round(time.perf_counter() - started, 1)
    progress(f"{engine} S={size} L={length}: {'fits' if ok else 'fails'} {'; '.join(errors)}")
    return record


def search(args: argparse.Namespace, engine: str, size: int) -> dict[str, Any]:
    """Doubling from --start x S, then bisection: the longest length that fits."""
    step = 8 * size
    attempts: list[dict[str, Any]] = []

    def fits(length: int) -> bool:
        attempts.append(attempt(args, engine, size, length))
        return bool(attempts[-1]["ok"])

    lo, hi = 0, None
    length = args.start * size
    while length <= args.limit:
        if not fits(length):
            hi = length
            break
        lo, length = length, length * 2
    if hi is None:
        return {
            "engine": engine,
            "sequence": size,
            "longest": lo,
            "capped": True,
            "attempts": attempts,
        }
    while lo == 0 or hi / lo > args.resolution:
        middle = (lo + hi) // 2 // step * step
        if middle <= lo or middle >= hi:
            break
        if fits(middle):
            lo = middle
        else:
            hi = middle
        if lo == 0 and hi <= step:
            break
    return {
        "engine": engine,
        "sequence": size,
        "longest": lo,
        "capped": False,
        "attempts": attempts,
    }


def per_token(result: dict[str, Any], budget: float) -> tuple[float | None, float | None]:
    """(activation bytes per token per rank, bytes the budget leaves for the rest) from the
    attempts that fit: the slope of their peak resident memory against tokens per rank."""
    size = result["sequence"]
    points = [(a["length"] / size, a["vmhwm_bytes"]) for a in result["attempts"] if a["ok"]]
    if len({x for x, _ in points}) < 2:
        return None, None
    (x0, y0), (x1, y1) = min(points), max(points)
    slope = (y1 - y0) / (x1 - x0)
    return slope, budget - slope * result["longest"] / size


def table(results: list[dict[str, Any]], budget_mib: float) -> str:
    lines = [
        f"Longest sequence that trains 2 ZeRO-3 steps with {budget_mib:g} MiB per rank beyond "
        "the engine after one short step (tiny Llama, vocabulary 4096, hidden 64)",
        "| engine | S (ranks) | longest length | tokens per rank | activation bytes per "
        "token per rank | budget left for the rest (MiB) | attempts |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        slope, rest = per_token(r, budget_mib * MiB)
        longest = f"{r['longest']}" + (" (limit)" if r["capped"] else "")
        slope_text = "-" if slope is None else f"{slope:,.0f}"
        rest_text = "-" if rest is None else f"{rest / MiB:.1f}"
        lines.append(
            f"| {r['engine']} | {r['sequence']} | {longest} | {r['longest'] // r['sequence']} | "
            f"{slope_text} | {rest_text} | {len(r['attempts'])} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], directory: str, budget_mib: float) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    engines = sorted(
        {r["engine"] for r in results}, key=["zerodp", "zerodp-tiled", "deepspeed"].index
    )
    sizes = sorted({r["sequence"] for r in results})
    figure, axis = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(engines)
    for index, engine in enumerate(engines):
        xs, ys = [], []
        for position, size in enumerate(sizes):
            found = [
                r["longest"] for r in results if r["engine"] == engine and r["sequence"] == size
            ]
            if found:
                xs.append(position + (index - (len(engines) - 1) / 2) * width)
                ys.append(found[0])
        axis.bar(xs, ys, width=width, label=engine)
    axis.set_xticks(range(len(sizes)), [f"S = {s}" for s in sizes])
    axis.set_ylabel("longest sequence (tokens)")
    axis.set_yscale("log", base=2)
    axis.set_title(f"ZeRO-3, {budget_mib:g} MiB per rank beyond the warmed-up engine")
    axis.legend()
    figure.tight_layout()
    path = Path(directory) / "sequence_fit.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        results, budget = saved["results"], saved["budget_mib"]
    else:
        budget = args.budget_mib
        results = []
        engines = args.engines.split(",")
        if "deepspeed" in engines and deepspeed_python(args.ds_python) is None:
            progress(f"deepspeed: {args.ds_python} cannot import it; left out")
            engines.remove("deepspeed")
        for size in (int(s) for s in args.sizes.split(",")):
            for engine in engines:
                results.append(search(args, engine, size))
        if args.json:
            Path(args.json).write_text(
                json.dumps({"budget_mib": budget, "model": MODEL, "results": results}, indent=1)
            )
    print(table(results, budget))
    path = plot(results, args.plots, budget)
    if path is not None:
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
