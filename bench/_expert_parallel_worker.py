"""One job of bench/expert_parallel.py, one process per rank (started by
bench/_scaling_launch.launch): a side-by-side comparison, or one capped fit attempt.

`compare`: for each optimizer (AdamW, SGD), the one-process reference first, then every
engine built from the same weights and stepped in turn on the same batches (engine A's
step, B's, C's, then the next step), each step between barriers and timed on the slowest
rank; per engine and step its loss, bytes by purpose and the most bytes gathered at once;
after the last step its model-state bytes and its weights against the reference.
DeepSpeed's AutoEP is first tried as it ships; when it does not start, the error is
recorded and the bench's patch (`patch_autoep_output_recorders`) is applied.

`fit`: one engine with `experts` experts per layer, two AdamW steps with the process's
private memory capped (RLIMIT_DATA) at what it held before the model was built plus the
budget: the whole model, the engine and the steps must fit in it. Any failure is "does not
fit"; the driver starts the next attempt in fresh processes.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench._expert_parallel_model import (  # noqa: E402
    AUTOEP_PATCH,
    OPTIMIZERS,
    RoutingLog,
    batch_for,
    patch_autoep_output_recorders,
    reference_run,
    routing_differences,
)
from bench._expert_parallel_runners import (  # noqa: E402
    AutoEPRunner,
    PlainRunner,
    ZeroDPRunner,
    autoep_start_failure,
)
from bench._fit_probe import record_misfit, vm_kib  # noqa: E402


def build_runner(engine: str, model: dict[str, int], optimizer: Any) -> Any:
    """`plain` (the round-off floor), `zerodp` (no EP), `zerodp-epE`, `autoep-epE`."""
    kind, _, ep = engine.partition("-ep")
    size = int(ep) if ep else 1
    runner = {"plain": PlainRunner, "zerodp": ZeroDPRunner, "autoep": AutoEPRunner}[kind]
    return runner(model, optimizer, size, engine)


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _timed_step(runner: Any, ids: torch.Tensor) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = runner.step(ids)
    return loss, _max_over_ranks(time.perf_counter() - start)


def compare_one(task: dict[str, Any], run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every engine of the task in one pass (see the module docstring): `run` names the
    optimizer, the steps, and whether the weights are compared after every step."""
    model, rank, world, steps = task["model"], dist.get_rank(), task["world"], run["steps"]
    optimizer = OPTIMIZERS[run["optimizer"]]
    reference = reference_run(model, optimizer, steps, world, every_step=run["check_each_step"])
    runners = [build_runner(engine, model, optimizer) for engine in task["engines"]]
    logs = [RoutingLog(r.module) for r in runners]
    records: list[dict[str, Any]] = [
        {"pass": run["name"], "engine": r.label, "optimizer": run["optimizer"]}
        | {"losses": [], "seconds": [], "traffic": [], "rerouted": [], "routed": 0}
        | {"weights_by_step": []}
        for r in runners
    ]
    for step in range(steps):
        ids = batch_for(step, rank, model["vocab"])
        for runner, record, log in zip(runners, records, logs, strict=True):
            loss, seconds = _timed_step(runner, ids)
            expected = reference.routes[step][rank]
            record["rerouted"].append(routing_differences(log.take(), expected))
            record["routed"] += sum(c.shape[0] for c in expected)
            record["losses"].append(abs(loss - reference.losses[step][rank]))
            record["seconds"].append(seconds)
            record["traffic"].append(runner.traffic())
            record["peak_gathered_bytes"] = runner.peak_gathered_bytes()
        if run["check_each_step"]:  # outside the timed steps
            for runner, record in zip(runners, records, strict=True):
                record["weights_by_step"].append(runner.weight_difference(reference.by_step[step]))
    for runner, record in zip(runners, records, strict=True):
        record["expert_state_bytes"], record["state_bytes"] = runner.state_bytes()
        record["weights"] = runner.weight_difference(reference.weights)
        record["median_s"] = statistics.median(record["seconds"][task["warmup"] :])
        record["min_s"] = min(record["seconds"][task["warmup"] :])
        runner.close()
    return records


def compare(task: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"rank": dist.get_rank(), "runs": [], "autoep": None}
    if any(e.startswith("autoep") for e in task["engines"]):
        size = next(int(e.split("-ep")[1]) for e in task["engines"] if e.startswith("autoep"))
        failure = autoep_start_failure(task["model"], OPTIMIZERS["adamw"], size)
        if failure:
            patch_autoep_output_recorders()
        result["autoep"] = {"unpatched_error": failure, "patch": AUTOEP_PATCH if failure else ""}
    for run in task["passes"]:
        result["runs"] += compare_one(task, run)
    return result


def fit(task: dict[str, Any]) -> dict[str, Any]:
    """Two AdamW steps of one engine under the cap (see the module docstring)."""
    result: dict[str, Any] = {"rank": dist.get_rank()}
    before = vm_kib("VmData") * 1024
    result["before_vmhwm_bytes"] = vm_kib("VmHWM") * 1024
    cap = before + task["budget_bytes"]
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    phases: dict[str, int] = {}
    try:
        runner = build_runner(task["engine"], task["model"], OPTIMIZERS["adamw"])
        phases["built"] = vm_kib("VmHWM") * 1024
        result["built_vmdata_bytes"] = vm_kib("VmData") * 1024
        for step in range(2):
            runner.step(batch_for(step, dist.get_rank(), task["model"]["vocab"]))
        phases["trained"] = vm_kib("VmHWM") * 1024
        result["expert_state_bytes"], result["state_bytes"] = runner.state_bytes()
        result["ok"] = True
    except BaseException as exc:  # any failure under the cap means it does not fit
        record_misfit(result, exc)
    result["before_vmdata_bytes"] = before
    result["vmhwm_bytes"] = vm_kib("VmHWM") * 1024
    result["phases_vmhwm_bytes"] = phases
    return result


def main() -> None:
    task_path, out_path = sys.argv[1], sys.argv[2]
    task = json.loads(Path(task_path).read_text())
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    engines = task["engines"] if task["kind"] == "compare" else [task["engine"]]
    if any(e.startswith("autoep") for e in engines):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        from bench._deepspeed import _skip_shm_op_build

        _skip_shm_op_build()
        deepspeed.init_distributed(dist_backend="gloo")
        if task["kind"] == "fit":
            patch_autoep_output_recorders()  # the compare job reports whether it is needed
    else:
        dist.init_process_group("gloo")
    from transformers import Qwen3MoeForCausalLM  # noqa: F401  (imported before a cap)

    import zerodp  # noqa: F401

    result = compare(task) if task["kind"] == "compare" else fit(task)
    ok = task["kind"] == "compare" or result["ok"]
    if ok:
        dist.barrier()
    Path(f"{out_path}.rank{dist.get_rank()}").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0 if ok else 3)  # a failed rank may have left a peer in a collective


if __name__ == "__main__":
    main()
