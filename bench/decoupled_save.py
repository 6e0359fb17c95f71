"""How long `save_checkpoint` holds training, decoupled writer against synchronous, and the
peak host memory (RSS) of each, on a 110M-parameter GPT at 2 ranks.

    python bench/decoupled_save.py [--stage 2] [--repeats 3] [--dir DIR] [--json OUT]

For each writer (`"checkpoint": {"writer": {"decoupled": false|true}}`) it starts
two ranks of its own (`torchrun --standalone --nproc_per_node 2`, gloo, so that each
writer's peak RSS is its own process's), trains one step (Adam's moments exist),
then saves `--repeats` times. Each save is timed on every rank from a barrier to
the return of `save_checkpoint` (the hold: the time training cannot go on), the
slowest rank's taken (the first decoupled save also allocates its host buffers,
which later saves reuse). The decoupled writer then trains `--steps-while-writing`
steps, timed, while its files are written, and `wait_for_checkpoint` returns when
they are committed (its `commit` column: from the call to that return); its step
time while writing is set against the steps before any save. RSS: each rank's
peak (VmHWM) before the first save and at the end, the larger rank's.

Expected: the decoupled call costs at most a tenth of the synchronous save; its
peak RSS exceeds the synchronous run's by about one copy of a rank's share of the
checkpoint (what it holds in host memory while writing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {"vocab_size": 32768, "seq_len": 128, "n_layer": 12, "n_head": 12, "d_model": 768}
MICRO_BATCH = 2


def _rss_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (the peak so far) of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import zerodp
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": args.stage},
        "checkpoint": {"writer": {"decoupled": args.mode == "decoupled"}},
    }
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    tokens = torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH, MODEL["seq_len"] + 1))

    def step() -> float:
        start = time.perf_counter()
        engine.backward(model.loss(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
        return time.perf_counter() - start

    quiet = [step() for _ in range(1 + args.steps_while_writing)][1:]  # the first warms up
    rss_before = _rss_mib("VmHWM")
    holds, commits, busy = [], [], []
    for repeat in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(args.dir, tag=f"r{repeat}")
        holds.append(time.perf_counter() - start)
        if args.mode == "decoupled":
            busy += [step() for _ in range(args.steps_while_writing)]
            engine.wait_for_checkpoint()
            commits.append(time.perf_counter() - start)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(Path(args.dir) / f"r{repeat}", ignore_errors=True)
    mine = {
        "hold": holds,
        "commit": commits,
        "step_quiet": statistics.median(quiet) if quiet else None,
        "step_writing": statistics.median(busy) if busy else None,
        "rss_peak_before": rss_before,
        "rss_peak": _rss_mib("VmHWM"),
        "params": sum(p.numel() for p in model.parameters()),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    engine.destroy()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(everyone), flush=True)


def run_writer(mode: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """Two ranks of the bench with one writer; their measurements, slowest/largest rank."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        "--worker",
        "--mode",
        mode,
        "--stage",
        str(args.stage),
        "--repeats",
        str(args.repeats),
        "--steps-while-writing",
        str(args.steps_while_writing),
        "--dir",
        str(directory / mode),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {mode} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    ranks = json.loads(lines[-1].removeprefix("RESULT "))
    holds = [max(r["hold"][i] for r in ranks) for i in range(args.repeats)]
    commits = [max(r["commit"][i] for r in ranks) for i in range(len(ranks[0]["commit"]))]
    quiet = [r["step_quiet"] for r in ranks if r["step_quiet"] is not None]
    busy = [r["step_writing"] for r in ranks if r["step_writing"] is not None]
    return {
        "writer": mode,
        "params": ranks[0]["params"],
        "hold_median_s": statistics.median(holds),
        "hold_first_s": holds[0],
        "hold_min_s": min(holds),
        "commit_median_s": statistics.median(commits) if commits else None,
        "step_quiet_s": max(quiet) if quiet else None,
        "step_while_writing_s": max(busy) if busy else None,
        "rss_peak_before_mib": max(r["rss_peak_before"] for r in ranks),
        "rss_peak_mib": max(r["rss_peak"] for r in ranks),
    }


def _cell(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.3f}{unit}" if unit == " s" else f"{value:.0f}{unit}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("sync", "decoupled"), help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps-while-writing", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (a tmp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    directory = args.dir or Path(tempfile.mkdtemp(prefix="decoupled_save_"))
    try:
        rows = [run_writer(mode, args, directory) for mode in ("sync", "decoupled")]
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    sync, decoupled = rows
    print(f"GPT {rows[0]['params'] / 1e6:.1f}M parameters, stage {args.stage}, 2 ranks (gloo)")
    print(
        "| writer | save holds training (median; first, min) | committed after | step | "
        "step while writing | peak RSS before saving | peak RSS |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['writer']} | {_cell(row['hold_median_s'], ' s')}; "
            f"{_cell(row['hold_first_s'], ' s')}, {_cell(row['hold_min_s'], ' s')} | "
            f"{_cell(row['commit_median_s'], ' s')} | "
            f"{_cell(row['step_quiet_s'], ' s')} | {_cell(row['step_while_writing_s'], ' s')} | "
            f"{_cell(row['rss_peak_before_mib'], ' MiB')} | {_cell(row['rss_peak_mib'], ' MiB')} |"
        )
    ratio = decoupled["hold_median_s"] / sync["hold_median_s"]
    print(f"decoupled hold / synchronous save: {ratio:.3f} (expected <= 0.1)")
    if args.json is not None:
        args.json.write_text(json.dumps({"stage": args.stage, "rows": rows, "ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
