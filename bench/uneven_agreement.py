"""What agreeing before each activity's collectives costs ([Note: agreeing before a collective]).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/uneven_agreement.py \
        [--models small,narrow] [--steps 4] [--repeats 5]

For each model and stage, zerodp with its stall checks (`comms_stall_checks`, the default,
which includes the agreement) and without, trained on the same batches and timed
interleaved. Per stage it prints the agreements per training step; the microseconds one
agreement takes with the ranks in step (medians of 9 blocks of 25 in a row, alternating
with blocks of all-reduces of one element on the default group, printed beside it); what
they add up to per step as a share of the step; and the step-time ratio with/without (a
second, noisier witness that also contains the stall checks). Then a checkpoint save and a
load at stage 3, each with its one agreement, with and without.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench._engines import EngineSpec, TrainSettings, ZeroDPRunner  # noqa: E402
from bench.step_time import (  # noqa: E402
    GENERIC_DEFAULTS,
    MODEL_DEFAULTS,
    MODELS,
    build_model,
    make_batches,
)
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402
from zerodp.comm.agreement import agreement  # noqa: E402
from zerodp.comm.faults.uneven_inputs import Activity  # noqa: E402


def _settings(model: str) -> TrainSettings:
    own = {**GENERIC_DEFAULTS, **MODEL_DEFAULTS.get(model, {})}
    return TrainSettings(
        micro_batch=own["micro_batch"],
        lr=1e-4,
        reduce_bucket_size=2_000_000,
        persistence_threshold=own["persistence_threshold"],
        prefetch_bucket_size=1_000_000,
    )


def _timed_steps(runner: ZeroDPRunner, batches: list, steps: int) -> tuple[float, int]:
    """Seconds per step and the agreements made over `steps` steps."""
    made = agreement().num_agreed
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        runner.train_step(batches[step % len(batches)])
    return (time.perf_counter() - start) / steps, agreement().num_agreed - made


def _per_agreement_us(runner: ZeroDPRunner, count: int, blocks: int = 9) -> tuple[float, float]:
    """Microseconds per agreement, and per all-reduce of one element on the default group,
    with the ranks in step (what an agreement adds where the ranks arrive together):
    medians over `blocks` alternating blocks of `count` each, so that load from elsewhere
    lands on both alike."""
    comm = runner.engine.comm
    tensor = torch.zeros(1)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(blocks):
        for agree in (True, False):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(count):
                if agree:
                    agreement().begin(Activity.STEP)
                    comm.agree_first("the benchmark")
                else:
                    dist.all_reduce(tensor)
            times[agree].append(1e6 * (time.perf_counter() - start) / count)
    return statistics.median(times[True]), statistics.median(times[False])


def _stage_row(model: str, stage: int, steps: int, repeats: int) -> str:
    cfg = MODELS[model]
    base = build_model(cfg, seed=1234)
    settings = _settings(model)
    runners = {
        checks: ZeroDPRunner(
            EngineSpec("zerodp", stage, stall_checks=checks), copy.deepcopy(base), settings
        )
        for checks in (True, False)
    }
    batches = make_batches(cfg, settings.micro_batch, 4, 1234, default_device())
    for runner in runners.values():
        for batch in batches[:2]:
            runner.train_step(batch)
    times: dict[bool, list[float]] = {True: [], False: []}
    made = 0
    for _ in range(repeats):
        for checks, runner in runners.items():
            seconds, n = _timed_steps(runner, batches, steps)
            times[checks].append(seconds)
            made += n if checks else 0
    each_us, all_reduce_us = _per_agreement_us(runners[True], 25)
    for runner in runners.values():
        runner.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    per_step = made / (steps * repeats)
    share = per_step * each_us * 1e-6 / on
    return (
        f"{model:<7} {stage:>5} {per_step:>11.1f} {each_us:>9.0f} {all_reduce_us:>10.0f} "
        f"{1e3 * on:>9.1f} {100 * share:>8.2f}% {on / off:>7.3f}"
    )


def _checkpoint_rows(model: str, repeats: int) -> str:
    """A save and a load at stage 3, each with its one agreement, with and without."""
    cfg = MODELS[model]
    base = build_model(cfg, seed=1234)
    settings = _settings(model)
    batches = make_batches(cfg, settings.micro_batch, 1, 1234, default_device())
    times: dict[tuple[bool, str], list[float]] = {}
    shared = [tempfile.mkdtemp() if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(shared, src=0)  # one directory for every rank (one host)
    try:
        runners = {
            checks: ZeroDPRunner(
                EngineSpec("zerodp", 3, stall_checks=checks), copy.deepcopy(base), settings
            )
            for checks in (True, False)
        }
        for runner in runners.values():
            runner.train_step(batches[0])
        for _ in range(repeats):
            for what in ("save", "load"):
                for checks, runner in runners.items():
                    dist.barrier()
                    start = time.perf_counter()
                    if what == "save":
                        runner.engine.save_checkpoint(shared[0], tag=f"t{checks}")
                    else:
                        runner.engine.load_checkpoint(shared[0], tag=f"t{checks}")
                    times.setdefault((checks, what), []).append(time.perf_counter() - start)
        for runner in runners.values():
            runner.close()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(shared[0], ignore_errors=True)
    rows = []
    for what in ("save", "load"):
        on = statistics.median(times[(True, what)])
        off = statistics.median(times[(False, what)])
        rows.append(f"{what:<5} {1e3 * on:>9.1f} {1e3 * off:>9.1f} {on / off:>7.3f}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,narrow")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ensure_process_group()
    torch.set_num_threads(1)
    models = args.models.split(",")
    rows = []
    for model in models:
        for stage in range(4):
            rows.append(_stage_row(model, stage, args.steps, args.repeats))
            if dist.get_rank() == 0:
                print(rows[-1], file=sys.stderr, flush=True)
    checkpoint = _checkpoint_rows(models[0], args.repeats)
    if dist.get_rank() == 0:
        print(
            f"\n{dist.get_world_size()} ranks, gloo; step times: medians of {args.repeats} "
            f"interleaved repeats of {args.steps} steps, with stall checks (and agreement) / "
            "without"
        )
        print("model   stage  agreed/step  us/agree  us/allred   ms/step  of a step  on/off")
        print("\n".join(rows))
        print(f"\ncheckpoint at stage 3 ({models[0]}), ms: with and without the agreement")
        print("what       with   without  on/off")
        print(checkpoint)
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
