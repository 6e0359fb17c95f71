"""How zerodp's cost grows: with the world size, with the model, and under a memory budget.

    python bench/scaling.py [--parts world,psi,fit] [--json out.json] [--plots DIR]

Three sweeps, each run as fresh multi-rank jobs of bench/_scaling_worker.py
(this script itself starts no process group):

- world: world sizes 2, 3, 4 (CPU ranks may outnumber cores: read the ratios to
  DDP at the same world size, not absolute times), step time against DDP and the
  collective bytes one rank sends per step against the ZeRO paper's 2Ψ / 3Ψ.
- psi: at world size 2, a GPT whose parameter count doubles four times; step
  time against DDP and per-rank model-state bytes against the paper's line.
- fit: at world size 2 under RLIMIT_DATA per rank, the deepest GPT each engine
  trains for two steps (doubling, then bisection; every attempt a fresh job).

Timing reuses bench/step_time.py (interleaved engines, slowest rank); DeepSpeed
runs when `--ds-python` can import it. Tables go to stdout, PNG plots to --plots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from bench._engines import parse_engines  # noqa: E402
from bench._scaling_launch import deepspeed_python, launch, rank_results  # noqa: E402
from bench._scaling_math import (  # noqa: E402
    DepthSearch,
    ideal_fit_params,
    ideal_wire_bytes,
    wire_bytes,
)
from bench._scaling_tables import fit_table, psi_table, world_table  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

MiB = 1 << 20
WORLD_MODEL = {"vocab_size": 2048, "seq_len": 64, "n_layer": 4, "n_head": 4, "d_model": 256}
# Depths 2..32: the blocks dominate the parameters, so Ψ about doubles with each.
PSI_BASE = {"vocab_size": 512, "seq_len": 64, "n_head": 4, "d_model": 128}
FIT_MODEL = {"vocab_size": 1024, "seq_len": 32, "n_head": 8, "d_model": 512}
BASELINE_GUESS = 300 * MiB  # an initialised rank's private memory before any model (measured)
_START = time.perf_counter()


def progress(message: str) -> None:
    print(f"[scaling {time.perf_counter() - _START:6.0f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--parts", default="world,psi,fit", help="which sweeps: world, psi, fit")
    p.add_argument("--json", metavar="PATH", help="also write every sweep's rows as JSON")
    p.add_argument("--plots", default="bench/results", metavar="DIR", help="PNG plots go here")
    p.add_argument(
        "--from-json",
        metavar="PATH",
        help="run nothing: print the tables and draw the plots of an earlier --json file",
    )
    p.add_argument("--world-sizes", default="2,3,4")
    p.add_argument(
        "--engines",
        default="ddp,zerodp,fsdp2,deepspeed",
        help="world and psi sweeps (deepspeed only where --ds-python imports it)",
    )
    p.add_argument("--psi-engines", default="ddp,zerodp,fsdp2", help="the psi sweep's engines")
    p.add_argument("--psi-layers", default="2,4,8,16,32", help="the psi sweep's depths")
    p.add_argument("--fit-engines", default="ddp,zerodp1,zerodp2,zerodp3,fsdp2,deepspeed")
    p.add_argument("--budget-mib", type=int, default=1024, help="RLIMIT_DATA per rank, MiB")
    p.add_argument("--fit-limit", type=int, default=256, help="deepest GPT tried, layers")
    p.add_argument("--steps", type=int, default=1, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--persistence-threshold", type=int, default=10_000, help="elements")
    p.add_argument("--prefetch-bucket-size", type=int, default=1_000_000, help="elements")
    p.add_argument(
        "--ds-python",
        default=os.environ.get("ZERODP_DS_PYTHON", sys.executable),
        help="an interpreter that imports deepspeed (default $ZERODP_DS_PYTHON, else this one)",
    )
    p.add_argument("--timeout", type=float, default=1200, help="seconds per job")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    args.part_list = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in args.part_list if x not in ("world", "psi", "fit")]
    if bad:
        p.error(f"unknown part(s) {', '.join(bad)}; choose from world, psi, fit")
    try:
        args.world_list = [int(x) for x in args.world_sizes.split(",")]
        args.psi_list = [int(x) for x in args.psi_layers.split(",")]
        for text in (args.engines, args.psi_engines, args.fit_engines):
            parse_engines(text)
    except ValueError as exc:
        p.error(str(exc))
    if any(n < 2 for n in args.world_list):
        p.error("--world-sizes must all be at least 2")
    return args


def _task(args: argparse.Namespace, kind: str, engines: str, **extra: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "engines": engines,
        "micro_batch": args.micro_batch,
        "reduce_bucket_size": 2_000_000,
        "persistence_threshold": args.persistence_threshold,
        "prefetch_bucket_size": args.prefetch_bucket_size,
        "seed": args.seed,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": 2,
        **extra,
    }


def _engines_here(text: str, ds: str | None, notes: list[str]) -> tuple[str, str]:
    """The engine list runnable here, and the interpreter to run it with."""
    specs = parse_engines(text)
    if any(s.engine == "deepspeed" for s in specs) and ds is None:
        note = "deepspeed skipped (--ds-python cannot import it)"
        if note not in notes:
            notes.append(note)
        specs = [s for s in specs if s.engine != "deepspeed"]
    python = ds if ds and any(s.engine == "deepspeed" for s in specs) else sys.executable
    return ",".join(s.label.replace("-", "") for s in specs), python


def timed_job(
    args: argparse.Namespace, engines: str, python: str, world: int, models: dict[str, Any]
) -> list[dict[str, Any]]:
    codes, out = launch(_task(args, "time", engines, models=models), world, python, args.timeout)
    if codes != [0] * world or not out.exists():
        raise RuntimeError(f"timed job at world size {world} failed: exit codes {codes}")
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    return rows


def world_sweep(args: argparse.Namespace, ds: str | None, notes: list[str]) -> list[dict[str, Any]]:
    engines, python = _engines_here(args.engines, ds, notes)
    rows = []
    for world in args.world_list:
        progress(f"world: size {world}, engines {engines}")
        for row in timed_job(args, engines, python, world, {"world": WORLD_MODEL}):
            kinds = {k: v["bytes"] for k, v in row["comm_by_kind_rank0"].items()}
            model_bytes = 4 * row["params"]
            row["model_bytes"] = model_bytes
            row["wire_bytes"] = wire_bytes(kinds, world) if row["comm_bytes_per_step"] else None
            row["ideal_wire_bytes"] = ideal_wire_bytes(model_bytes, row["stage"], world)
            rows.append(row)
    return rows


def psi_sweep(args: argparse.Namespace, ds: str | None, notes: list[str]) -> list[dict[str, Any]]:
    engines, python = _engines_here(args.psi_engines, ds, notes)
    models = {f"L{n}": PSI_BASE | {"n_layer": n} for n in args.psi_list}
    progress(f"psi: layers {args.psi_layers}, engines {engines}")
    return timed_job(args, engines, python, 2, models)


def gpt_params(cfg: dict[str, Any]) -> int:
    """Parameters of a GPT config (tied embedding once), counted without allocating it."""
    with torch.device("meta"):
        return GPT(GPTConfig(**cfg)).num_params()


def _fit_one(
    args: argparse.Namespace, label: str, python: str, depth: int, log: list[dict[str, Any]]
) -> bool:
    model = FIT_MODEL | {"n_layer": depth}
    task = _task(args, "fit", label, model=model, budget_bytes=args.budget_mib * MiB)
    started = time.perf_counter()
    # Small mallocs from few arenas, big ones mapped and unmapped: the cap then measures
    # what the engine holds rather than allocator slack.
    env = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    codes, out = launch(task, 2, python, args.timeout, env)
    ranks = rank_results(out, 2)
    ok = codes == [0, 0] and all(r is not None and r.get("ok") for r in ranks)
    errors = sorted({r["error"] for r in ranks if r and not r.get("ok")})
    if not ok and not errors:
        errors = [f"a rank died before reporting (exit codes {codes})"]
    log.append(
        {
            "engine": label,
            "depth": depth,
            "params": gpt_params(model),
            "ok": ok,
            "errors": errors,
            "baseline_vmdata_bytes": max((r or {}).get("baseline_vmdata_bytes", 0) for r in ranks),
            "vmhwm_bytes": max((r or {}).get("vmhwm_bytes", 0) for r in ranks),
            "seconds": time.perf_counter() - started,
        }
    )
    progress(f"fit: {label} depth {depth}: {'fits' if ok else 'fails'} {'; '.join(errors)}")
    return ok


def fit_sweep(args: argparse.Namespace, ds: str | None, notes: list[str]) -> list[dict[str, Any]]:
    engines, _ = _engines_here(args.fit_engines, ds, notes)
    budget = args.budget_mib * MiB
    per_layer = gpt_params(FIT_MODEL | {"n_layer": 2}) - gpt_params(FIT_MODEL | {"n_layer": 1})
    rows = []
    for spec in parse_engines(engines):
        label = spec.label.replace("-", "")
        python = ds if spec.engine == "deepspeed" and ds else sys.executable
        ideal = ideal_fit_params(budget, BASELINE_GUESS, spec.stage, 2)
        fixed = gpt_params(FIT_MODEL | {"n_layer": 0})
        guess = max(1, min(args.fit_limit, (ideal - fixed) // per_layer * 3 // 4))
        log: list[dict[str, Any]] = []
        search = DepthSearch(
            lambda d, label=label, python=python, log=log: _fit_one(args, label, python, d, log),
            start=guess,
            limit=args.fit_limit,
        )
        depth = search.run()
        measured = [a["baseline_vmdata_bytes"] for a in log if a["baseline_vmdata_bytes"]]
        if measured:  # the bound from this engine's own start-up memory, not the guess
            ideal = ideal_fit_params(budget, max(measured), spec.stage, 2)
        failed = [a for a in log if not a["ok"] and a["depth"] == depth + 1]
        rows.append(
            {
                "engine": spec.engine,
                "stage": spec.stage,
                "label": spec.label,
                "max_depth": depth,
                "max_params": gpt_params(FIT_MODEL | {"n_layer": depth}) if depth else 0,
                "ideal_max_params": ideal,
                "first_failure": failed[0]["errors"] if failed else None,
                "attempts": log,
            }
        )
    ddp = next((r for r in rows if r["engine"] == "ddp"), None)
    for row in rows:
        row["vs_ddp"] = row["max_params"] / ddp["max_params"] if ddp and ddp["max_params"] else None
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ds = deepspeed_python(args.ds_python)
    notes: list[str] = []
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    sweeps = {"world": world_sweep, "psi": psi_sweep, "fit": fit_sweep}
    tables = {"world": world_table, "psi": psi_table, "fit": fit_table}
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        args.json = None
    for part in args.part_list:
        if args.from_json and not results.get(part):
            continue
        if not args.from_json:
            results[part] = sweeps[part](args, ds, notes)
        print(tables[part](results[part], args) + "\n", flush=True)
    results.setdefault("notes", notes)
    for note in results["notes"]:
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"rows written to {args.json}")
    from bench._scaling_plots import write_plots

    chosen = {part: results.get(part) for part in args.part_list}
    for path in write_plots(chosen, Path(args.plots)):
        print(f"plot written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
