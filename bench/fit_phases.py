"""Private memory after each phase of a few zerodp steps on scaling.py's memory-cap GPT.

    MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 \
        torchrun --standalone --nproc_per_node 2 bench/fit_phases.py --engine zerodp3 --layers 24

The memory-cap search (scaling.py `fit`) says only whether a depth fits; this says where
the memory goes: rank 0's `VmData` (what RLIMIT_DATA caps) after each forward, backward
and step, over its value before the model was built, and `VmPeak` growth, which shows in
which phase the high-water mark was set. Run it uncapped with the search's malloc settings
(above): with glibc's default, growing mmap threshold, freed blocks stay in the heap and
the figures move by tens of MiB between runs of the same code. The reducer's bucket-pool
figures (`held max`: the most bucket elements held at once; `idle`: held with no
reduction using them) are read from `engine.reducer`.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import step_time  # noqa: E402
from bench._engines import TrainSettings, ZeroDPRunner, parse_engines  # noqa: E402
from bench.scaling import FIT_MODEL  # noqa: E402
from examples.gpt import GPTConfig  # noqa: E402
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402

MiB = 1 << 20


def _vm_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="zerodp3", help="zerodp0..zerodp3")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--persistence-threshold", type=int, default=10_000)
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    ensure_process_group()
    spec = parse_engines(args.engine)[0]
    if spec.engine != "zerodp":
        raise SystemExit(f"--engine must be a zerodp stage (zerodp0..zerodp3), got {args.engine}")
    settings = TrainSettings(
        micro_batch=args.micro_batch,
        lr=1e-4,
        reduce_bucket_size=2_000_000,  # as scaling.py's fit tasks
        persistence_threshold=args.persistence_threshold,
        prefetch_bucket_size=1_000_000,
    )
    device = default_device()
    data0, peak0 = _vm_mib("VmData"), _vm_mib("VmPeak")
    cfg = GPTConfig(**(FIT_MODEL | {"n_layer": args.layers}))
    model = step_time.build_model(cfg, 1234).to(device)
    batches = step_time.make_batches(cfg, args.micro_batch, args.steps, 1234, device)
    runner = step_time.build_runner(spec, model, settings, device)
    assert isinstance(runner, ZeroDPRunner)
    del model
    engine = runner.engine
    lines = []

    def note(phase: str) -> None:
        held = engine.reducer.bucket_numel_held * 4 / MiB
        idle = engine.reducer.bucket_numel_idle * 4 / MiB
        lines.append(
            f"{phase:<18} VmData +{_vm_mib('VmData') - data0:7.1f}  "
            f"VmPeak +{_vm_mib('VmPeak') - peak0:7.1f}  pool held max {held:5.1f}  idle {idle:5.1f}"
        )

    note("built")
    for step in range(args.steps):
        loss = engine(*batches[step])
        note(f"step {step} forward")
        engine.backward(loss)
        note(f"step {step} backward")
        engine.step()
        note(f"step {step} step")
    if dist.get_rank() == 0:
        print(f"{args.engine}, {args.layers} layers, rank 0, MiB (pool: fp32 elements x 4)")
        print("\n".join(lines), flush=True)
    dist.barrier()
    engine.destroy()
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
