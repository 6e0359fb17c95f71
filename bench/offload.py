"""ZeRO-Offload: step time against the same stage without offload, and where the bytes are.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/offload.py \
        [--model small] [--dtype fp32|bf16] [--stages 1,2,3] [--steps N] [--repeats R] \
        [--nvme-path DIR] [--json out.json]
    python bench/offload.py --adamw-kernels [--numel N] [--repeats R]

`--adamw-kernels` (one process, one thread, no training) times one step of
torch's CPU AdamW on one fp32 tensor of N elements with `fused=True` and with
`foreach=True`, interleaved: the reason the host step defaults to the fused
kernel (docs/offload.md).

For each stage, zerodp without offload, with `offload_optimizer` (and, at stage 3,
`offload_param`) on the host, and in files under --nvme-path, each train their own
copy of the bench GPT on the same batches (timed interleaved, as step_time.py does).
Columns: the step time and its ratio to the same stage without offload; the share of
the step spent in the host optimizer step; this rank's device and host model-state
bytes beside the ZeRO-Offload figures (device: parameters and gradients; host: fp32
copy and Adam moments, 12 bytes per parameter / N). On a CPU-only machine "device"
and "host" are the same memory: the copies run in full, but their cost is a memcpy,
and the host step competes with nothing; see bench/README.md for what this can and
cannot show.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerodp  # noqa: E402
from bench._engines import LossModel, TrainSettings  # noqa: E402
from bench._measure import timed  # noqa: E402
from bench.step_time import MODELS, build_model, make_batches, progress  # noqa: E402
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402
from zerodp.monitor import ideal_offload_bytes  # noqa: E402
from zerodp.optim.offloaded_step import OffloadedSteps  # noqa: E402


class HostStepClock:
    """Time spent in the host optimizer step (`OffloadedSteps.step`), summed over calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = OffloadedSteps.step
        clock = self

        def step(self: OffloadedSteps, inner: Any, states: Any) -> None:
            start = time.perf_counter()
            try:
                clock._original(self, inner, states)
            finally:
                clock.seconds += time.perf_counter() - start

        OffloadedSteps.step = step  # type: ignore[method-assign]


def _train(engine: zerodp.ZeroEngine, batches: list[Any]) -> None:
    for batch in batches:
        engine.backward(engine(*batch))
        engine.step()


def _config(settings: TrainSettings, stage: int, where: str, nvme: str | None) -> dict[str, Any]:
    config = settings.zerodp_config(stage)
    if where != "none":
        device = "nvme" if where == "nvme" else "cpu"
        offload = {"device": device, "nvme_path": nvme, "pin_memory": True}
        config["zero_optimization"]["offload_optimizer"] = dict(offload)
        if stage == 3:
            config["zero_optimization"]["offload_param"] = dict(offload)
    return config


def adamw_kernels(numel: int, repeats: int) -> dict[str, Any]:
    """Median seconds of one CPU AdamW step, fused against foreach, on one thread.

    Both optimizers step their own copy of the same tensor with the same gradient,
    one step each in turn (interleaved), after 3 untimed steps (the fused kernel
    and the state are set up by the first).
    """
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator)
    kernels: dict[str, Any] = {}
    for name in ("fused", "foreach"):
        param = torch.nn.Parameter(start.clone())
        param.grad = grad.clone()
        kernels[name] = torch.optim.AdamW([param], lr=1e-3, **{name: True})
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for repeat in range(3 + repeats):
        for name, optimizer in kernels.items():
            tic = time.perf_counter()
            optimizer.step()
            if repeat >= 3:
                times[name].append(time.perf_counter() - tic)
    fused, foreach = (statistics.median(times[name]) for name in ("fused", "foreach"))
    return {"numel": numel, "fused_s": fused, "foreach_s": foreach, "ratio": foreach / fused}


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(MODELS))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="default 3 (--adamw-kernels: 20)")
    p.add_argument("--nvme-path", default=None, help="default: a temporary directory")
    p.add_argument("--json", default=None)
    p.add_argument("--adamw-kernels", action="store_true", help="time CPU AdamW, fused vs foreach")
    p.add_argument("--numel", type=int, default=4 * 2**20, help="--adamw-kernels: elements")
    args = p.parse_args(argv)
    if args.adamw_kernels:
        repeats = args.repeats or 20
        result = adamw_kernels(args.numel, repeats)
        print(
            f"torch {torch.__version__} CPU AdamW, one fp32 tensor of {result['numel']:,} "
            f"elements, 1 thread, median of {repeats} interleaved steps: "
            f"fused {result['fused_s'] * 1e3:.1f} ms, foreach {result['foreach_s'] * 1e3:.1f} "
            f"ms, foreach / fused {result['ratio']:.2f}x"
        )
        return
    args.repeats = args.repeats or 3
    ensure_process_group()
    device = default_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    nvme_root = Path(args.nvme_path or tempfile.mkdtemp(prefix="zerodp-bench-nvme-"))
    settings = TrainSettings(
        micro_batch=8,
        lr=1e-4,
        reduce_bucket_size=2_000_000,
        persistence_threshold=10_000,
        prefetch_bucket_size=1_000_000,
        dtype=args.dtype,
    )
    cfg = MODELS[args.model]
    base: LossModel = build_model(cfg, 1234)
    params = base.gpt.num_params()
    batches = make_batches(cfg, settings.micro_batch, args.steps, 1234, device)
    clock = HostStepClock()
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        cases = {}
        for where in ("none", "cpu", "nvme"):
            progress(f"stage {stage}: building zerodp with offload {where}")
            engine, _, _, _ = zerodp.initialize(
                model=copy.deepcopy(base).to(device),
                config=_config(settings, stage, where, str(nvme_root / f"rank{rank}")),
            )
            for batch in batches[:2]:  # warm up
                engine.backward(engine(*batch))
                engine.step()
            cases[where] = {"engine": engine, "times": [], "host": 0.0}
        for _ in range(args.repeats):
            for case in cases.values():
                engine = case["engine"]
                before = clock.seconds
                seconds = timed(lambda engine=engine: _train(engine, batches), device)
                case["times"].append(seconds / len(batches))
                case["host"] += clock.seconds - before
        base_time = sorted(cases["none"]["times"])[len(cases["none"]["times"]) // 2]
        for where, case in cases.items():
            engine = case["engine"]
            memory = engine.model_state_bytes()
            median = sorted(case["times"])[len(case["times"]) // 2]
            total = sum(case["times"]) * len(batches)
            ideal_device, ideal_host = ideal_offload_bytes(
                params, stage, world, mixed=args.dtype == "bf16", offload_params=stage == 3
            )
            rows.append(
                {
                    "stage": stage,
                    "offload": where,
                    "median_s": median,
                    "ratio": median / base_time,
                    "host_step_share": case["host"] / total if where != "none" else 0.0,
                    "device_bytes": memory.device_total,
                    "host_bytes": memory.host_total,
                    "host_grad_bytes": memory.host_grads,
                    "ideal_device_bytes": ideal_device if where != "none" else None,
                    "ideal_host_bytes": ideal_host if where != "none" else None,
                }
            )
            engine.destroy()
    if rank == 0:
        print(
            f"{args.model} GPT, {params / 1e6:.1f}M params, {args.dtype}, {world} ranks, "
            f"{device.type}; {args.steps} steps x {args.repeats} repeats, interleaved"
        )
        header = ("stage", "offload", "median ms", "x no-offload", "host step", "device MiB",
                  "ideal", "host MiB", "ideal", "+ host grad buffers MiB")  # fmt: skip
        print(" | ".join(header))
        for r in rows:
            ideal_d = _mib(r["ideal_device_bytes"])
            ideal_h = _mib(r["ideal_host_bytes"])
            host_state = r["host_bytes"] - r["host_grad_bytes"]
            cells = [
                str(r["stage"]),
                r["offload"],
                f"{r['median_s'] * 1e3:.1f}",
                f"{r['ratio']:.2f}",
                f"{r['host_step_share'] * 100:.1f}%",
                _mib(r["device_bytes"]),
                ideal_d,
                _mib(host_state),
                ideal_h,
                _mib(r["host_grad_bytes"]),
            ]
            print(" | ".join(cells))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
