"""Step time of zerodp compiled against eager at every stage, and FSDP2's, in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/compile.py \
        [--engines zerodp0,zerodp1,zerodp2,zerodp3,fsdp2] [--backend inductor] \
        [--steps 2] [--repeats 5] [--layers 4] [--d-model 256]

Every engine trains its own copy of one seeded GPT (bench/_engines.py's LossModel, fp32
AdamW) twice: eagerly, and compiled. zerodp is compiled by its `compile` config block: the
whole model at stages 0-2, each transformer block at stage 3 (the default). FSDP2 is
compiled as torchtitan does it: `torch.compile` on each block, then `fully_shard` on each
block and on the root. Each compiled runner is warmed up (compiled) before timing; then all
runners are timed interleaved, `--steps` steps per sample, `--repeats` samples each, so
noise on a shared machine lands on all of them alike. The table gives each engine's median
step time eager and compiled, the speedup (eager / compiled, > 1: compiling helps), and the
compiled step time over FSDP2's compiled step time.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerodp  # noqa: E402
from bench._engines import (  # noqa: E402
    Batch,
    EngineSpec,
    LossModel,
    Runner,
    TrainSettings,
    ZeroDPRunner,
    build_fsdp2,
    parse_engines,
)
from bench._measure import median_min, timed  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402

_START = time.perf_counter()


def progress(message: str) -> None:
    if dist.get_rank() == 0:
        print(
            f"[compile {time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True
        )


class CompiledZeroDPRunner(ZeroDPRunner):
    """zerodp with its `compile` block enabled (per block at stage 3, whole model otherwise)."""

    def __init__(
        self,
        spec: EngineSpec,
        model: LossModel,
        settings: TrainSettings,
        backend: str,
        per_block: bool | None = None,
    ) -> None:
        Runner.__init__(self, spec)
        config = settings.zerodp_config(spec.stage)
        config["compile"] = {"enabled": True, "backend": backend, "per_block": per_block}
        self.engine, _, _, _ = zerodp.initialize(model=model, config=config)


def build_runner(
    spec: EngineSpec,
    model: LossModel,
    settings: TrainSettings,
    compiled: bool,
    backend: str,
    per_block: bool | None = None,
) -> Runner:
    if spec.engine == "zerodp":
        if compiled:
            return CompiledZeroDPRunner(spec, model, settings, backend, per_block)
        return ZeroDPRunner(spec, model, settings)
    if spec.engine == "fsdp2":
        if compiled:  # torchtitan's order: compile each block, then shard
            blocks = model.gpt.blocks
            for i, block in enumerate(blocks):
                blocks[i] = torch.compile(block, backend=backend)  # type: ignore[assignment]
        return build_fsdp2(spec, model, settings, default_device())
    raise ValueError(f"bench/compile.py compares zerodp and fsdp2, not {spec.label}")


def make_batches(cfg: GPTConfig, micro_batch: int, count: int) -> list[Batch]:
    rank = dist.get_rank()
    batches = []
    for step in range(count):
        gen = torch.Generator().manual_seed(1234 + rank * 10_007 + step)
        data = torch.randint(cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=gen)
        data = data.to(default_device())
        batches.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return batches


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="zerodp0,zerodp1,zerodp2,zerodp3,fsdp2")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=2, help="steps per timed sample")
    p.add_argument("--repeats", type=int, default=5, help="timed samples per runner")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (compiles)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument(
        "--stage3-whole", action="store_true", help="add zerodp-3 compiled as a whole model"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_process_group()
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        n_layer=args.layers,
        n_head=max(1, args.d_model // 64),
        d_model=args.d_model,
    )
    settings = TrainSettings(
        micro_batch=args.micro_batch,
        lr=1e-4,
        reduce_bucket_size=2_000_000,
        persistence_threshold=10_000,
        prefetch_bucket_size=1_000_000,
    )
    specs = parse_engines(args.engines)
    variants: list[tuple[str, EngineSpec, bool | None]] = [(s.label, s, None) for s in specs]
    if args.stage3_whole:
        variants.append(("zerodp-3-whole", EngineSpec("zerodp", 3), False))
    torch.manual_seed(0)
    base = LossModel(GPT(cfg)).to(default_device())
    batches = make_batches(cfg, args.micro_batch, 4)
    runners: dict[tuple[str, bool], Runner] = {}
    compile_s: dict[str, float] = {}
    for label, spec, per_block in variants:
        for compiled in (False, True):
            if not compiled and per_block is not None:
                continue  # its eager twin is the plain row's
            model = copy.deepcopy(base)
            runner = build_runner(spec, model, settings, compiled, args.backend, per_block)
            start = time.perf_counter()
            for i in range(args.warmup):
                runner.train_step(batches[i % len(batches)])
            if compiled:
                compile_s[label] = time.perf_counter() - start
            runners[(label, compiled)] = runner
            progress(f"{label} {'compiled' if compiled else 'eager'} warmed up")
    samples: dict[tuple[str, bool], list[float]] = {key: [] for key in runners}
    device = default_device()
    for repeat in range(args.repeats):
        for key, runner in runners.items():

            def run(runner: Runner = runner) -> None:
                for i in range(args.steps):
                    runner.train_step(batches[i % len(batches)])

            samples[key].append(timed(run, device) / args.steps)
        progress(f"repeat {repeat + 1}/{args.repeats}")
    medians = {key: median_min(values)[0] for key, values in samples.items()}
    if dist.get_rank() == 0:
        print(
            f"GPT {cfg.n_layer} layers, d_model {cfg.d_model}, seq {cfg.seq_len}, vocab "
            f"{cfg.vocab_size}, micro-batch {args.micro_batch}, world {dist.get_world_size()}, "
            f"backend {args.backend}; median of {args.repeats} samples of {args.steps} steps"
        )
        fsdp2 = medians.get(("fsdp2", True))
        print("engine         eager ms  compiled ms  speedup  compiled/fsdp2-compiled  warm-up s")
        for label, spec, _ in variants:
            eager, compiled = medians[(spec.label, False)], medians[(label, True)]
            versus = f"{compiled / fsdp2:.2f}" if fsdp2 else "-"
            print(
                f"{label:14s} {eager * 1e3:8.1f}  {compiled * 1e3:11.1f}  "
                f"{eager / compiled:7.2f}  {versus:>23s}  {compile_s[label]:9.1f}"
            )
    for runner in runners.values():
        runner.close()
    destroy_process_group_if_owned()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
