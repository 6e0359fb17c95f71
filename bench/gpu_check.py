"""One CUDA GPU, world size 1: exactness of every stage on the device, then step time and
peak allocated memory against the ZeRO formula. Run by `bench/gpu_check.sh`.

    torchrun --standalone --nproc_per_node 1 bench/gpu_check.py --rows rows.tsv

Each check appends one tab-separated row (check, result, detail) to `--rows`, which the
shell script prints as one table with the other checks' rows.

- exact: stages 0-3, and the CUDA-only paths (optimizer offload to pinned host memory,
  parameter offload, bf16), each trained 3 steps on the bench GPT against a plain copy of
  the model with torch's AdamW on the same device: at world size 1 ideal data parallelism
  is the single model, so every difference is zerodp's (non_blocking copies read before
  they landed, a buffer reused while a copy still reads it).
- time/memory: each stage's median step time over `--steps` timed steps, and the peak of
  `torch.cuda.max_memory_allocated` during a step beside `ideal_model_state_bytes` (the
  paper's 16 bytes per parameter at world size 1) and the engine's own model-state count.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

import zerodp  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from zerodp.comm import destroy_process_group_if_owned, ensure_process_group  # noqa: E402
from zerodp.monitor import ideal_model_state_bytes  # noqa: E402

EXACT_CASES: dict[str, tuple[int, dict[str, Any], str]] = {
    "stage 0": (0, {}, "fp32"),
    "stage 1": (1, {}, "fp32"),
    "stage 2": (2, {}, "fp32"),
    "stage 3": (3, {}, "fp32"),
    "stage 3, units per module": (3, {"stage3_units": "modules"}, "fp32"),
    "stage 2, optimizer offload (pinned)": (
        2,
        {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "fp32",
    ),
    "stage 3, optimizer+param offload": (
        3,
        {
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        },
        "fp32",
    ),
    "stage 3, bf16": (3, {}, "bf16"),
}
SMALL = GPTConfig(vocab_size=8192, seq_len=128, n_layer=4, n_head=4, d_model=256)
LR = 1e-3


def _config(stage: int, zero: dict[str, Any], dtype: str, micro_batch: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 10_000,
            **zero,
        },
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _batches(cfg: GPTConfig, micro_batch: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [
        torch.randint(cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=gen).cuda()
        for _ in range(count)
    ]


def check_exact(name: str, stage: int, zero: dict[str, Any], dtype: str) -> tuple[str, str]:
    cfg = GPTConfig(vocab_size=512, seq_len=32, n_layer=3, n_head=2, d_model=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    reference = copy.deepcopy(model).cuda()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0, fused=True)
    engine, *_ = zerodp.initialize(model=model, config=_config(stage, zero, dtype, 4))
    worst = 0.0
    for tokens in _batches(cfg, 4, 3):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        engine.backward(engine.module.loss(inputs, targets))
        engine.step()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            ref_loss = reference.loss(inputs, targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for (pname, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        full = zerodp.utils.safe_get_full_fp32_param(param)
        if full is None:
            return "FAIL", f"{pname}: no full value"
        diff = (full.float() - ref.detach().float()).abs().max().item()
        worst = max(worst, diff if math.isfinite(diff) else math.inf)  # NaN fails too
    engine.destroy()
    # fp32: round-off only. bf16: zerodp computes in bf16 with fp32 masters, the reference
    # under autocast; Adam moves a weight by at most about lr a step, so two runs whose
    # gradients differ in rounding stay within 2 lr a step of each other, while a copy read
    # before it landed (garbage, zeros, last step's values) is off by far more or by NaN.
    limit = 1e-5 if dtype == "fp32" else 2 * LR * 3
    return ("ok" if worst <= limit else "FAIL"), f"max |w - w_ref| {worst:.2e} (limit {limit:g})"


def time_stage(stage: int, steps: int, micro_batch: int) -> tuple[str, str]:
    torch.manual_seed(0)
    model = GPT(SMALL)
    num_params = model.num_params()
    engine, *_ = zerodp.initialize(model=model, config=_config(stage, {}, "fp32", micro_batch))
    batches = _batches(SMALL, micro_batch, 2)
    times = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for index in range(steps + 2):
        tokens = batches[index % 2]
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.backward(engine.module.loss(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
        torch.cuda.synchronize()
        if index >= 2:  # two warm-up steps: the optimizer's state is allocated in the first
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    state = engine.model_state_bytes().total
    ideal = ideal_model_state_bytes(num_params, stage, 1)
    engine.destroy()
    ms = statistics.median(times) * 1e3
    detail = (
        f"{ms:.1f} ms/step; peak allocated {peak / 2**20:.1f} MiB; model states "
        f"{state / 2**20:.1f} MiB, ZeRO formula {ideal / 2**20:.1f} MiB "
        f"({num_params / 1e6:.2f}M params, peak - formula = activations and buffers)"
    )
    ok = abs(state - ideal) <= 0.1 * ideal
    return ("ok" if ok else "FAIL"), detail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", required=True, help="append result rows (TSV) here")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=8)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check.py: no CUDA device", file=sys.stderr)
        return 2
    ensure_process_group()
    failed = False
    with open(args.rows, "a") as out:
        for name, (stage, zero, dtype) in EXACT_CASES.items():
            try:
                result, detail = check_exact(name, stage, zero, dtype)
            except Exception as exc:  # a check that crashes is a failed row, not a lost table
                result, detail = "FAIL", f"{type(exc).__name__}: {exc}"[:300]
            failed |= result != "ok"
            out.write(f"exact on cuda: {name}\t{result}\t{detail}\n")
            out.flush()
        for stage in range(4):
            try:
                result, detail = time_stage(stage, args.steps, args.micro_batch)
            except Exception as exc:
                result, detail = "FAIL", f"{type(exc).__name__}: {exc}"[:300]
            failed |= result != "ok"
            out.write(f"step time, small GPT: stage {stage}\t{result}\t{detail}\n")
            out.flush()
    destroy_process_group_if_owned()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
