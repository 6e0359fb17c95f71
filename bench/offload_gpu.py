"""On an accelerator: the largest GPT that trains at each stage, with and without offload.

    torchrun --standalone --nproc_per_node 1 bench/offload_gpu.py [--d-model 2048] \
        [--max-layers 256] [--step-layers 4] [--fixed-layers 8] [--dtype bf16] [--json out.json]

For each stage (1, 2, 3) and offload setting (none; optimizer to the host; at stage 3
also parameters), GPT layers are added `--step-layers` at a time until a training step
runs out of device memory; the last size that trained is reported with its parameter
count and step time. Then one fixed size (`--fixed-layers`) is timed for every setting.
Each attempt runs in a fresh engine after emptying the allocator's cache. Meant for
CUDA (it needs `torch.cuda.OutOfMemoryError` and the allocator's statistics); on a
CPU-only machine it refuses to run, since there is no device memory to run out of.
"""

from __future__ import annotations

import argparse
import gc
import json
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
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402

SETTINGS = [
    (1, "none"),
    (1, "optimizer"),
    (2, "none"),
    (2, "optimizer"),
    (3, "none"),
    (3, "optimizer"),
    (3, "optimizer+params"),
]


def _config(stage: int, offload: str, dtype: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 100_000}
    if "optimizer" in offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if "params" in offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def attempt(layers: int, d_model: int, stage: int, offload: str, dtype: str) -> dict[str, Any]:
    """Build and train two steps; the step time of the second, or the error that stopped it."""
    device = default_device()
    cfg = GPTConfig(vocab_size=32000, seq_len=512, n_layer=layers, n_head=16, d_model=d_model)
    engine = None
    try:
        with zerodp.zero.Init(config=_config(stage, offload, dtype), enabled=stage == 3):
            model = GPT(cfg)
        engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage, offload, dtype))
        tokens = torch.randint(cfg.vocab_size, (1, cfg.seq_len + 1), device=device)
        seconds = 0.0
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.backward(engine.module.loss(tokens[:, :-1], tokens[:, 1:]))
            engine.step()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())
        peak = torch.cuda.max_memory_allocated()
        return {"ok": True, "params": params, "step_s": seconds, "peak_bytes": peak}
    except torch.cuda.OutOfMemoryError as error:
        return {"ok": False, "error": str(error).splitlines()[0]}
    finally:
        if engine is not None:
            engine.destroy()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--max-layers", type=int, default=256)
    p.add_argument("--step-layers", type=int, default=4)
    p.add_argument("--fixed-layers", type=int, default=8)
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/offload_gpu.py needs a CUDA device (it measures device memory)")
    ensure_process_group()
    results: dict[str, Any] = {"largest": [], "fixed": []}
    for stage, offload in SETTINGS:
        largest = None
        for layers in range(args.step_layers, args.max_layers + 1, args.step_layers):
            outcome = attempt(layers, args.d_model, stage, offload, args.dtype)
            if not outcome["ok"]:
                break
            largest = {"layers": layers, **outcome}
        results["largest"].append({"stage": stage, "offload": offload, "largest": largest})
        print(f"stage {stage} offload {offload}: largest {largest}", flush=True)
    for stage, offload in SETTINGS:
        outcome = attempt(args.fixed_layers, args.d_model, stage, offload, args.dtype)
        results["fixed"].append({"stage": stage, "offload": offload, **outcome})
        print(f"stage {stage} offload {offload}: {args.fixed_layers} layers {outcome}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
