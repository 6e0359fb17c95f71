"""One torchrun job of bench/scaling.py: a timed sweep point, or one capped fit attempt.

    torchrun --standalone --nproc_per_node N bench/_scaling_worker.py TASK.json OUT.json

`time` tasks hand their GPT configs to bench/step_time.py's `bench_model`, so
the engines, their interleaved timing and their byte counts are exactly the
step-time bench's. `fit` tasks set RLIMIT_DATA (the process's private memory:
heap, anonymous mappings, thread stacks) on every rank once the process group
is up, build one engine on one GPT and train two steps under it; any failure
is reported as not fitting, and the driver starts the next attempt in a fresh
process so a failed allocation cannot poison it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import warnings
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import step_time  # noqa: E402
from bench._engines import TrainSettings, parse_engines  # noqa: E402
from bench._fit_probe import record_misfit, vm_kib  # noqa: E402
from bench._report import fill_ratios, row_json  # noqa: E402
from examples.gpt import GPTConfig  # noqa: E402
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402


def _settings(task: dict[str, Any]) -> TrainSettings:
    return TrainSettings(
        micro_batch=task["micro_batch"],
        lr=1e-4,
        reduce_bucket_size=task["reduce_bucket_size"],
        persistence_threshold=task["persistence_threshold"],
        prefetch_bucket_size=task["prefetch_bucket_size"],
    )


def run_time(task: dict[str, Any]) -> list[dict[str, Any]]:
    """Every engine on every model of the task, timed interleaved by step_time.bench_model."""
    specs = parse_engines(task["engines"])
    settings = _settings(task)
    args = argparse.Namespace(
        steps=task["steps"], repeats=task["repeats"], warmup=task["warmup"], seed=task["seed"]
    )
    rows = []
    for name, cfg in task["models"].items():
        # bench_model looks its model up by name; register ours beside small and medium.
        step_time.MODELS[name] = GPTConfig(**cfg)
        step_time.DEFAULT_SCHEDULE[name] = (task["steps"], task["repeats"])
        rows += step_time.bench_model(name, specs, settings, args)
    fill_ratios(rows)
    return [row_json(row, dist.get_world_size()) for row in rows]


def run_fit(task: dict[str, Any]) -> dict[str, Any]:
    """Two steps of one engine on one GPT under RLIMIT_DATA; what fits, never raises."""
    spec = parse_engines(task["engines"])[0]
    settings = _settings(task)
    device = default_device()
    baseline = vm_kib("VmData") * 1024
    budget = task["budget_bytes"]
    resource.setrlimit(resource.RLIMIT_DATA, (budget, budget))
    result: dict[str, Any] = {"baseline_vmdata_bytes": baseline, "rank": dist.get_rank()}
    try:
        cfg = GPTConfig(**task["model"])
        model = step_time.build_model(cfg, task["seed"]).to(device)
        result["params"] = model.gpt.num_params()
        batches = step_time.make_batches(cfg, settings.micro_batch, 2, task["seed"], device)
        runner = step_time.build_runner(spec, model, settings, device)
        del model
        step_time.run_steps(runner, batches, 2)
        result["ok"] = True
    except BaseException as exc:  # any failure under the cap means the model does not fit
        record_misfit(result, exc)
    result["vmhwm_bytes"] = vm_kib("VmHWM") * 1024
    return result


def main() -> None:
    task_path, out_path = sys.argv[1], sys.argv[2]
    task = json.loads(Path(task_path).read_text())
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    ensure_process_group()
    rank = dist.get_rank()
    if task["kind"] == "fit":
        result = run_fit(task)
        if result["ok"]:
            dist.barrier()  # both ranks done with the last step's collectives
        Path(f"{out_path}.rank{rank}").write_text(json.dumps(result))
        # A failed rank may have left a peer inside a collective: leave without teardown,
        # and let torchrun stop the peers.
        sys.stdout.flush()
        os._exit(0 if result["ok"] else 3)
    rows = run_time(task)
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows, indent=1))
    dist.barrier()
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
