"""Write the DeepSpeed checkpoints zerodp's tests load, and DeepSpeed's own continuation of them.

    pip install -e ".[fixtures]"   # DeepSpeed 0.19.8; never a dependency of zerodp itself
    DS_ACCELERATOR=cpu python tools/make_deepspeed_fixtures.py [--out DIR] [--only stage2_fp32]
    DS_ACCELERATOR=cpu python tools/make_deepspeed_fixtures.py --universal-only [--only ...]

For each ZeRO stage (1, 2, 3) and precision (fp32, bf16, fp16) it trains the
run of `tests/deepspeed_run.py` with DeepSpeed at world size 2 (gloo, CPU),
saves a checkpoint after `SAVED_AT` optimizer steps, then lets DeepSpeed take
`CONTINUED` more steps and records, after the save and after each further
step: the global mean loss, the lr and loss scale each step used (and the
loss scale after it), every
parameter's fp32 master weights, Adam moments and training-dtype weights, all
read through DeepSpeed's own accessors. Those records go to
`<fixture>/expected.safetensors` (tensors, plus a JSON header entry), next to
the checkpoint (`latest`, `global_step3/`). The checkpoints in `UNIVERSAL` are
also converted with DeepSpeed's `ds_to_universal` (`global_step3_universal/`,
`latest_universal`); `--universal-only` converts the checkpoints already there
without training again (how stage1_fp16's universal folder was added).

`CLIENT_FIXTURE` (stage 2, fp32) is the same run started as DeepSpeed-Chat or
an HF Trainer starts it: its own torch AdamW and StepLR passed to
`deepspeed.initialize` (the config names neither) and a client_state of every
plain kind (`tests/deepspeed_run.client_state`), for `zerodp convert` to carry.

It also records DeepSpeed's learning-rate schedules step by step
(`schedules.json`): the lr each optimizer step uses, for several settings of
WarmupLR, WarmupDecayLR and WarmupCosineLR.

DeepSpeed copies its recovery scripts into every checkpoint folder; they are
removed here (they are DeepSpeed's code, not data). The first run compiles
DeepSpeed's CPU Adam kernel (a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import deepspeed_run as run  # noqa: E402

TAG = f"global_step{run.SAVED_AT}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _snapshot(engine: Any, model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master, moments and model weights, through DeepSpeed's accessors."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = engine.optimizer
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        # Stages 1-2 link each parameter to its moments once, before the first step made
        # them; link again so that DeepSpeed's accessor finds them.
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            out[f"{prefix}.fp32.{name}"] = safe_get_full_fp32_param(param).detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                value = safe_get_full_optimizer_state(param, key)
                out[f"{prefix}.{key}.{name}"] = value.detach().clone()
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        for name, param in model.named_parameters():
            out[f"{prefix}.model.{name}"] = param.detach().clone().contiguous()
    return {k: v.float() if k.split(".")[1] != "model" else v for k, v in out.items()}


def _worker(
    rank: int, port: int, stage: int, precision: str, folder: str, client: bool = False
) -> None:
    world = run.DEEPSPEED_WORLD_SIZE
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = run.build_model()
    if client:  # the run's own optimizer and scheduler, as DeepSpeed-Chat passes them
        cfg = run.client_config(world)
        optimizer = run.client_optimizer(model)
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=run.client_scheduler(optimizer),
            config=cfg,
        )
    else:
        cfg = run.config(stage, precision, world)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=run.param_groups(model), config=cfg
        )
    dtype = next(engine.module.parameters()).dtype
    losses: list[float] = []
    lrs: list[list[float]] = []
    scales: list[float] = []
    scales_after: list[float] = []

    def train_step(step: int) -> None:
        x, y = run.rank_batch(step, rank, world)
        lrs.append([float(lr) for lr in engine.get_lr()])
        scales.append(float(getattr(engine.optimizer, "cur_scale", 1.0)))
        loss = run.loss_of(engine(x.to(dtype)), y)
        engine.backward(loss)
        engine.step()
        scales_after.append(float(getattr(engine.optimizer, "cur_scale", 1.0)))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)

    for step in range(1, run.SAVED_AT + 1):
        train_step(step)
    saved = run.client_state() if client else {"epoch": 4, "note": "fixture"}
    engine.save_checkpoint(folder, tag=TAG, client_state=saved)
    records = _snapshot(engine, model, "saved")
    for step in range(run.SAVED_AT + 1, run.SAVED_AT + run.CONTINUED + 1):
        train_step(step)
        records.update(_snapshot(engine, model, f"step{step}"))
    if rank == 0:
        from safetensors.torch import save_file

        header = {
            "deepspeed_version": deepspeed.__version__,
            "config": cfg,
            "world_size": world,
            "saved_at": run.SAVED_AT,
            "losses": losses,
            "lrs": lrs,
            "loss_scales": scales,
            "loss_scales_after": scales_after,
            "skipped_steps": int(engine.skipped_steps),
        }
        save_file(
            {k: v.contiguous() for k, v in sorted(records.items())},
            str(Path(folder) / "expected.safetensors"),
            metadata={"record": json.dumps(header)},
        )
    dist.barrier()
    dist.destroy_process_group()


def make_checkpoint(out: Path, stage: int, precision: str, client: bool = False) -> Path:
    folder = out / (run.CLIENT_FIXTURE if client else run.fixture_name(stage, precision))
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    mp.spawn(
        _worker,
        args=(_free_port(), stage, precision, str(folder), client),
        nprocs=run.DEEPSPEED_WORLD_SIZE,
    )
    for script in folder.glob("*.py"):  # DeepSpeed's recovery scripts: its code, not data
        script.unlink()
    return folder


def make_universal(folder: Path) -> None:
    """DeepSpeed's own converter; a plain model needs its universal_checkpoint_info injected."""
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(folder / TAG),
        "--output_folder",
        str(folder / f"{TAG}_universal"),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
        "--inject_missing_state",
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


# -- the learning-rate schedules -------------------------------------------------------------

SCHEDULE_CASES: list[dict[str, Any]] = [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01}},
    {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.5, "warmup_num_steps": 7},
    },
    {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
    },
    {"type": "WarmupLR", "params": {"warmup_max_lr": 0.3, "warmup_num_steps": 1}},
    {
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": 20, "warmup_min_lr": 0.001, "warmup_num_steps": 6},
    },
    {
        "type": "WarmupDecayLR",
        "params": {
            "total_num_steps": 12,
            "warmup_max_lr": 0.2,
            "warmup_num_steps": 5,
            "warmup_type": "linear",
        },
    },
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 9, "warmup_num_steps": 1}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5}},
    {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": 15,
            "warmup_num_steps": 4,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.01,
            "warmup_type": "linear",
        },
    },
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 1}},
]
SCHEDULE_STEPS = 25
SCHEDULE_GROUP_LRS = (0.1, 0.04)  # two param groups, each with its own lr


def record_schedules() -> dict[str, Any]:
    """The lr of each param group at optimizer steps 1..SCHEDULE_STEPS, as DeepSpeed sets it.

    DeepSpeed's engine steps the optimizer, then the scheduler; the lr a step
    uses is the one in the param group right before it.
    """
    from deepspeed.runtime import lr_schedules

    cases = []
    for case in SCHEDULE_CASES:
        weights = [torch.nn.Parameter(torch.zeros(2)) for _ in SCHEDULE_GROUP_LRS]
        optimizer = torch.optim.SGD(
            [{"params": [w], "lr": lr} for w, lr in zip(weights, SCHEDULE_GROUP_LRS, strict=True)]
        )
        scheduler = getattr(lr_schedules, case["type"])(optimizer, **case["params"])
        used = []
        for _ in range(SCHEDULE_STEPS):
            used.append([float(group["lr"]) for group in optimizer.param_groups])
            optimizer.step()
            scheduler.step()
        cases.append({**case, "lrs": used, "state_dict": scheduler.state_dict()})
    import deepspeed

    return {
        "deepspeed_version": deepspeed.__version__,
        "group_lrs": list(SCHEDULE_GROUP_LRS),
        "cases": cases,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests/data/deepspeed_checkpoints")
    parser.add_argument("--only", default=None, help="one fixture, e.g. stage2_fp32")
    parser.add_argument(
        "--universal-only",
        action="store_true",
        help="convert the existing checkpoints of the UNIVERSAL fixtures (or of --only) with "
        "ds_to_universal, without training them again",
    )
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.universal_only:
        for stage, precision in run.UNIVERSAL:
            name = run.fixture_name(stage, precision)
            if args.only in (None, name):
                shutil.rmtree(args.out / name / f"{TAG}_universal", ignore_errors=True)
                make_universal(args.out / name)
                print(f"converted {args.out / name}", flush=True)
        return 0
    for stage in run.STAGES:
        for precision in run.PRECISIONS:
            if args.only not in (None, run.fixture_name(stage, precision)):
                continue
            folder = make_checkpoint(args.out, stage, precision)
            if (stage, precision) in run.UNIVERSAL:
                make_universal(folder)
            print(f"wrote {folder}", flush=True)
    if args.only in (None, run.CLIENT_FIXTURE):
        folder = make_checkpoint(args.out, run.CLIENT_STAGE, "fp32", client=True)
        print(f"wrote {folder}", flush=True)
    if args.only is None:
        (args.out / "schedules.json").write_text(json.dumps(record_schedules(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
