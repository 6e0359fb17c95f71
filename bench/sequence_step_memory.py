"""What one training step adds per token per rank: zerodp, DeepSpeed and plain PyTorch.

    python bench/sequence_step_memory.py                      # S = 1, lengths 512 and 1024
    python bench/sequence_step_memory.py --sequence 2         # S = 2 ranks, 1024 and 2048
    python bench/sequence_step_memory.py --lengths 256 768 --engines plain zerodp

bench/sequence_fit.py's bytes-per-token column is the slope of each fitting attempt's
lifetime peak resident memory (VmHWM). That peak includes building the engine: where
building peaks higher than a short row's step does (DeepSpeed's process peaks about 80 MB
higher before its first step), the short rows add nothing to it and the slope reads low.
Here the step is measured alone. Each (engine, length) runs in fresh processes (S ranks):
the engine is built, one warm-up step runs at the length (the optimizer state exists after
it), the peak is reset (`/proc/self/clear_refs`), and a second step's peak above the
resident memory before it is read on every rank (the largest is reported). glibc's mmap
threshold is fixed at 64 KiB, so a freed tensor leaves resident memory at once. The slope
between two lengths, against the tokens each rank holds (length / S), is what a token
costs a rank's step.

The model and the engines are bench/sequence_fit.py's (tiny Llama, vocabulary 4096, ZeRO
stage 3, AdamW, one row; DeepSpeed's Ulysses as its tutorial wires it, untiled); "plain"
is the model and torch's AdamW in one process, no engine (S = 1 only). DeepSpeed runs where
it is installed (DS_ACCELERATOR=cpu is set here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench._fit_probe import vm_kib  # noqa: E402
from bench.sequence_fit import MODEL  # noqa: E402

ENGINES = ("plain", "zerodp", "zerodp-tiled", "deepspeed")
MiB = 2**20


def _step_peak(engine: str, length: int, sequence: int) -> dict[str, Any]:
    """In a worker rank: bytes the second step's peak holds above the memory before it."""
    import torch

    from bench._sequence_fit_worker import build_model, deepspeed_engine, row, zerodp_engine

    torch.set_num_threads(1)
    task = {
        "model": MODEL,
        "length": length,
        "sequence": sequence,
        "tiled": engine == "zerodp-tiled",
    }
    model = build_model(MODEL, length)
    if engine == "plain":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def train(step: int, length: int) -> None:
            ids = row(task, step, length)
            out = model(input_ids=ids, labels=ids)  # held through the backward, as the engines'
            out.loss.backward()  # loops hold theirs (its logits: vocabulary x 4 B a token)
            optimizer.step()
            optimizer.zero_grad()

    elif engine == "deepspeed":
        import deepspeed

        from bench._deepspeed import _skip_shm_op_build

        _skip_shm_op_build()
        deepspeed.init_distributed(dist_backend="gloo")
        train = deepspeed_engine(task, model)
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        train = zerodp_engine(task, model)
    train(0, length)
    before = vm_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    train(1, length)
    return {"engine": engine, "length": length, "bytes": (vm_kib("VmHWM") - before) * 1024}


def _measure(engine: str, length: int, sequence: int) -> int | None:
    """The largest step peak of the S ranks, each a fresh process."""
    from zerodp.testing.ranks import run_ranks

    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "DS_ACCELERATOR": "cpu"}
    argv = [__file__, "--worker", engine, str(length), str(sequence)]
    exits = run_ranks(argv, world_size=sequence, timeout_s=600, env=env)
    peaks = []
    for rank_exit in exits:
        lines = [line for line in rank_exit.output.splitlines() if line.startswith("{")]
        if rank_exit.status != 0 or not lines:
            print(f"{engine} at {length}, rank {rank_exit.rank}: failed", file=sys.stderr)
            print(rank_exit.output[-1500:], file=sys.stderr)
            return None
        peaks.append(json.loads(lines[-1])["bytes"])
    return max(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence", type=int, default=1, help="S: ranks holding one row")
    parser.add_argument("--lengths", type=int, nargs=2, help="default: 512 and 1024 times S")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        engine, length, sequence = args.worker[0], int(args.worker[1]), int(args.worker[2])
        print(json.dumps(_step_peak(engine, length, sequence)), flush=True)
        return
    size = args.sequence
    engines = [e for e in args.engines if size == 1 or e != "plain"]
    if "deepspeed" in engines:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            print("deepspeed is not installed: its row is left out", file=sys.stderr)
            engines.remove("deepspeed")
    short, long = args.lengths or (512 * size, 1024 * size)
    rows = []
    for engine in engines:
        measured = [_measure(engine, length, size) for length in (short, long)]
        if measured[0] is None or measured[1] is None:
            continue
        peaks = (measured[0], measured[1])
        rows.append((engine, peaks, (peaks[1] - peaks[0]) / ((long - short) / size)))
    print(
        f"S = {size}: one row of {short} and of {long} tokens, {short // size} and "
        f"{long // size} per rank; the largest rank's step peak"
    )
    plain = {engine: slope for engine, _, slope in rows}.get("plain")
    print(
        "| engine | step peak, short row (MiB) | long row (MiB) | bytes per token per rank "
        "| x plain PyTorch |"
    )
    print("|---|---|---|---|---|")
    for engine, peaks, slope in rows:
        ratio = f"{slope / plain:.3f}" if plain else "-"
        print(
            f"| {engine} | {peaks[0] / MiB:.1f} | {peaks[1] / MiB:.1f} | {slope:,.0f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
