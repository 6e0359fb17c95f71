"""Step time, model-state memory and traffic of zerodp against DDP, FSDP2 and friends.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/step_time.py \
        [--json out.json] [--steps N] [--repeats R] [--models small,medium] [--engines ...]

Every engine trains its own copy of one seeded GPT on the same per-rank
random batches with fp32 AdamW. Engines are timed interleaved (A, B, C, A,
B, C, ...) so noise on a shared machine lands on all of them alike; see
bench/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerodp  # noqa: E402
from bench._deepspeed import DeepSpeedRunner, deepspeed_missing_reason  # noqa: E402
from bench._engines import (  # noqa: E402
    ALL_SPECS,
    ENGINE_CHOICES,
    Batch,
    EngineSpec,
    LossModel,
    Runner,
    TrainSettings,
    ZeroDPRunner,
    build_ddp,
    build_fsdp2,
    build_zero_redundancy,
    parse_engines,
)
from bench._measure import median_min, timed  # noqa: E402
from bench._report import Measured, Row, fill_ratios, format_table, write_json  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.moe_gpt import MoEGPT, MoEGPTConfig  # noqa: E402
from zerodp.comm import default_device, destroy_process_group_if_owned, ensure_process_group  # noqa: E402
from zerodp.monitor import ideal_model_state_bytes  # noqa: E402

MODELS: dict[str, GPTConfig] = {
    "small": GPTConfig(vocab_size=8192, seq_len=128, n_layer=4, n_head=4, d_model=256),
    "medium": GPTConfig(vocab_size=8192, seq_len=128, n_layer=6, n_head=6, d_model=384),
    # Not in the default --models: the small model with 8 experts (top 2) per block, its MoE
    # layers stage 3 leaves (zerodp and DeepSpeed); DDP with find_unused_parameters.
    "moe": MoEGPTConfig(
        vocab_size=8192, seq_len=128, n_layer=4, n_head=4, d_model=256, d_expert=512
    ),
    # Not in the default --models: many tiny blocks, so that each engine's own work per
    # module (hooks, gather bookkeeping, one small collective at a time) dominates the step,
    # as it does on an accelerator where a block's compute takes microseconds.
    "narrow": GPTConfig(vocab_size=512, seq_len=16, n_layer=48, n_head=2, d_model=32),
}
# (steps per repeat, repeats) when not given: a few minutes in all on two CPU cores.
DEFAULT_SCHEDULE: dict[str, tuple[int, int]] = {
    "small": (2, 5),
    "medium": (1, 3),
    "moe": (1, 3),
    "narrow": (4, 6),
}
# Settings a model has of its own unless given on the command line: the narrow model shards
# everything (persistence threshold 0) at a micro-batch of 4.
MODEL_DEFAULTS: dict[str, dict[str, int]] = {
    "narrow": {"micro_batch": 4, "persistence_threshold": 0},
}
GENERIC_DEFAULTS: dict[str, int] = {"micro_batch": 8, "persistence_threshold": 10_000}
# Engines whose per-block cost the "per-module cost" line reports (stage 3 ones).
PER_MODULE_ENGINES = (
    "zerodp-3",
    "zerodp-3-nocheck",
    "zerodp-3-modules",
    "fsdp2",
    "deepspeed-3",
)
# Engines that cannot train the MoE model as it is (FSDP2 wraps whole blocks only here).
MOE_UNSUPPORTED = ("fsdp2",)
_START = time.perf_counter()
FOOTNOTE = (
    "state: this rank's parameter, gradient and optimizer-state bytes (largest rank); ideal: the\n"
    "ZeRO paper's 16 bytes/param split by stage (DDP 0, zero_redundancy 1, fsdp2 3).\n"
    "comm: bytes of the full tensor each collective works on (all-reduce tensor, reduce-scatter\n"
    "input, all-gather output), so an all-reduce of N counts N though on the wire it costs about\n"
    "what a reduce-scatter plus an all-gather of N (2N here) cost. n/a: not measurable."
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    p.add_argument("--steps", type=int, help="timed steps per repeat (default: small 2, medium 1)")
    p.add_argument("--repeats", type=int, help="interleaved repeats (default: small 5, medium 3)")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps per engine before timing, at least 2: the last two measure "
        "model-state bytes and collective bytes",
    )
    p.add_argument("--models", default="small,medium", help=f"from {', '.join(MODELS)}")
    p.add_argument("--engines", default="all", help=f"'all' or from: {ENGINE_CHOICES}")
    p.add_argument(
        "--micro-batch", type=int, help="sequences per rank per step (default 8; narrow 4)"
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--reduce-bucket-size", type=int, default=2_000_000, help="elements")
    p.add_argument(
        "--persistence-threshold", type=int, help="stage 3, elements (default 10000; narrow 0)"
    )
    p.add_argument("--prefetch-bucket-size", type=int, default=1_000_000, help="stage 3, elements")
    p.add_argument(
        "--unit-numel",
        type=int,
        default=0,
        help="zerodp stage3_unit_numel: modules this small are gathered as one unit (0: the "
        "engine's default, each repeated block one unit)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument(
        "--profile-stage3", metavar="PATH", help="profile one zerodp stage 3 step on rank 0"
    )
    p.add_argument("--profile-model", default="small", help="the model --profile-stage3 uses")
    args = p.parse_args(argv)
    for name in ("steps", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1, got {value}")
    if args.warmup < 2:
        p.error(
            f"--warmup must be at least 2 (bytes are measured on the last two), got {args.warmup}"
        )
    unknown = [m for m in _split(args.models) if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    try:
        args.specs = list(ALL_SPECS) if args.engines == "all" else parse_engines(args.engines)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def progress(message: str) -> None:
    """To stderr on rank 0 only, so the table on stdout stays clean."""
    if is_rank0():
        print(
            f"[bench {time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True
        )


def build_model(cfg: GPTConfig, seed: int) -> LossModel:
    """The one model every engine copies: same seed, so the same weights on every rank."""
    torch.manual_seed(seed)
    return LossModel(MoEGPT(cfg) if isinstance(cfg, MoEGPTConfig) else GPT(cfg))


def make_batches(
    cfg: GPTConfig, micro_batch: int, count: int, seed: int, device: torch.device
) -> list[Batch]:
    """Random tokens, different per rank and per step, made before timing starts."""
    rank = dist.get_rank()
    batches = []
    for step in range(count):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
        data = torch.randint(cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=gen)
        data = data.to(device)
        batches.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return batches


def build_runner(
    spec: EngineSpec, model: LossModel, settings: TrainSettings, device: torch.device
) -> Runner:
    if spec.engine == "zerodp":
        return ZeroDPRunner(spec, model, settings)
    if spec.engine == "deepspeed":
        return DeepSpeedRunner(spec, model, settings, dist.get_world_size())
    builder = {"ddp": build_ddp, "fsdp2": build_fsdp2, "zero_redundancy": build_zero_redundancy}
    return builder[spec.engine](spec, model, settings, device)


def max_over_ranks(value: int | None, device: torch.device) -> int | None:
    """The largest rank's figure (shards can be uneven); None if any rank has none."""
    box = torch.tensor([-1 if value is None else value], dtype=torch.int64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    low = torch.tensor([-1 if value is None else value], dtype=torch.int64, device=device)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return None if int(low.item()) < 0 else int(box.item())


def measure_bytes(runner: Runner, batches: list[Batch], device: torch.device) -> Measured:
    """Model-state bytes and collective bytes of one step each, totals from the rank with most."""
    state = runner.model_state(batches[0])
    comm_bytes, by_kind = runner.comm(batches[-1])
    state_bytes = max_over_ranks(state.total if state is not None else None, device)
    return Measured(state, state_bytes, max_over_ranks(comm_bytes, device), by_kind)


def run_steps(runner: Runner, batches: list[Batch], steps: int) -> None:
    for i in range(steps):
        runner.train_step(batches[i % len(batches)])


def bench_model(
    name: str, specs: list[EngineSpec], settings: TrainSettings, args: argparse.Namespace
) -> list[Row]:
    """Build every engine on one model, warm up, measure bytes, then time them interleaved."""
    device = default_device()
    cfg = MODELS[name]
    settings = settings_for(name, settings, args)
    steps, repeats = DEFAULT_SCHEDULE[name]
    steps, repeats = args.steps or steps, args.repeats or repeats
    base = build_model(cfg, args.seed)
    params = base.gpt.num_params()
    if isinstance(cfg, MoEGPTConfig):
        specs = [s for s in specs if s.engine not in MOE_UNSUPPORTED]
    batches = make_batches(cfg, settings.micro_batch, max(steps, args.warmup, 1), args.seed, device)
    runners: list[Runner] = []
    try:
        for spec in specs:
            progress(f"{name}: building {spec.label}")
            runners.append(build_runner(spec, copy.deepcopy(base).to(device), settings, device))
        progress(f"{name}: warming up ({args.warmup} steps each, measuring bytes on the last 2)")
        measured = []
        for runner in runners:
            run_steps(runner, batches, args.warmup - 2)
            measured.append(measure_bytes(runner, batches, device))
        samples: list[list[float]] = [[] for _ in runners]
        for rep in range(repeats):
            for runner, times in zip(runners, samples, strict=True):
                times.append(timed(partial(run_steps, runner, batches, steps), device) / steps)
            summary = ", ".join(
                f"{r.spec.label} {t[-1] * 1e3:.0f}" for r, t in zip(runners, samples, strict=True)
            )
            progress(f"{name}: repeat {rep + 1}/{repeats} (ms/step): {summary}")
    finally:
        for runner in runners:
            runner.close()
        del runners
        gc.collect()
    world = dist.get_world_size()
    rows = []
    for spec, times, bytes_ in zip(specs, samples, measured, strict=True):
        median_s, min_s = median_min(times)
        # zerodp and DeepSpeed keep half-precision parameters (the paper's 2+2+12 bytes);
        # torch's engines keep fp32 parameters under autocast/MixedPrecisionPolicy.
        mixed = settings.bf16 and spec.engine in ("zerodp", "deepspeed")
        ideal = ideal_model_state_bytes(params, spec.stage, world, mixed=mixed)
        rows.append(Row(spec, name, params, steps, times, median_s, min_s, ideal, bytes_))
    return rows


def settings_for(model: str, base: TrainSettings, args: argparse.Namespace) -> TrainSettings:
    """`base` with the model's own micro-batch and persistence threshold, unless given."""
    chosen = {
        key: getattr(args, key)
        if getattr(args, key) is not None
        else MODEL_DEFAULTS.get(model, {}).get(key, default)
        for key, default in GENERIC_DEFAULTS.items()
    }
    return dataclasses.replace(base, **chosen)


# Functions whose calls per step the profile counts (file suffix, function name).
PROFILE_COUNTED = (
    ("zero_parameter.py", "__torch_function__"),
    ("module_hooks.py", "_pre_forward"),
    ("module_hooks.py", "_post_forward"),
    ("coordinator.py", "pre_backward"),
    ("coordinator.py", "post_backward"),
    ("saved_tensors.py", "pack"),
    ("saved_tensors.py", "_unpack"),
    ("reducer.py", "contribute"),
    ("gather.py", "to_inflight"),
    ("reducer.py", "_launch"),
)


def profile_stage3(path: str, settings: TrainSettings, args: argparse.Namespace) -> None:
    """One zerodp stage 3 step under cProfile on rank 0: the top entries and call counts.

    Written to `path`: counts per step of the engine's hot entry points (its
    `__torch_function__`, module hooks, saved-tensor hooks, gathers and
    reductions), the collectives of the step by kind, then the top 30 functions
    by own time.
    """
    import cProfile
    import io
    import pstats

    device = default_device()
    model = args.profile_model
    if model not in MODELS:
        raise SystemExit(f"--profile-model {model!r}: choose from {', '.join(MODELS)}")
    cfg = MODELS[model]
    settings = settings_for(model, settings, args)
    batches = make_batches(cfg, settings.micro_batch, max(args.warmup, 1), args.seed, device)
    runner = ZeroDPRunner(EngineSpec("zerodp", 3), build_model(cfg, args.seed).to(device), settings)
    try:
        run_steps(runner, batches, args.warmup)
        stats = runner.engine.comm.stats
        stats.reset()
        dist.barrier()
        profiler = cProfile.Profile()
        if is_rank0():
            profiler.enable()
        start = time.perf_counter()
        runner.train_step(batches[0])
        elapsed = time.perf_counter() - start
        if is_rank0():
            profiler.disable()
            table = pstats.Stats(profiler)
            lines = [
                f"zerodp stage 3, model {model}, one step on rank 0 under cProfile "
                f"({elapsed * 1e3:.0f} ms with the profiler on)",
                "calls per step:",
            ]
            for (file, _, func), (_, ncalls, *_rest) in table.stats.items():  # type: ignore[attr-defined]
                for suffix, name in PROFILE_COUNTED:
                    if file.endswith(suffix) and func == name:
                        lines.append(f"  {suffix}:{name}  {ncalls}")
            for kind, entry in sorted(stats.snapshot().items()):
                lines.append(f"  collective {kind}: {entry}")
            out = io.StringIO()
            ordered = pstats.Stats(profiler, stream=out).sort_stats("tottime")
            ordered.print_stats(30)
            ordered.print_callers(r"zero_parameter.py.*__torch_function__")
            Path(path).write_text("\n".join(lines) + "\n\n" + out.getvalue(), encoding="utf-8")
            print(f"stage 3 profile ({model} model, rank 0) written to {path}")
    finally:
        runner.close()


def variant_cost(rows: list[Row]) -> list[str]:
    """What a check costs, per model: zerodp-3 over zerodp-3-nocheck (the collective order
    check) and zerodp-N over zerodp-N-nowatch (the stall checks: uneven inputs, failed peers).

    Repeats are interleaved, so repeat i of one ran next to repeat i of the other: the
    median of the per-repeat ratios is the figure to quote; the ratio of the medians and
    of the minimums are shown too.
    """
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        labels = {r.spec.label: r for r in rows if r.model == model}
        for with_check, without, what in (
            ("zerodp-3", "zerodp-3-nocheck", "order check"),
            *((f"zerodp-{s}", f"zerodp-{s}-nowatch", "stall checks") for s in (1, 2, 3)),
        ):
            checked, unchecked = labels.get(with_check), labels.get(without)
            if checked is None or unchecked is None:
                continue
            pairs = zip(checked.samples_s, unchecked.samples_s, strict=True)
            paired = sorted(a / b for a, b in pairs)
            medians = checked.median_s / unchecked.median_s
            lines.append(
                f"{what} ({model}): {with_check} / {without} = "
                f"{statistics.median(paired):.3f} (median of {len(paired)} paired repeats; "
                f"range {paired[0]:.3f}-{paired[-1]:.3f}); medians {medians:.3f}, "
                f"minimums {checked.min_s / unchecked.min_s:.3f}"
            )
    return lines


def per_module_cost(rows: list[Row]) -> list[str]:
    """(stage 3 engine's step - DDP's step) / blocks, in microseconds, per model.

    What each stage 3 engine adds per transformer block: its hooks, gather and
    release bookkeeping and the block's collectives. From the medians, and from
    the median of per-repeat differences (repeat i of both ran side by side).
    """
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        by_label = {r.spec.label: r for r in rows if r.model == model}
        ddp = by_label.get("ddp")
        if ddp is None:
            continue
        blocks = MODELS[model].n_layer
        parts = []
        for label in PER_MODULE_ENGINES:
            row = by_label.get(label)
            if row is None:
                continue
            paired = statistics.median(
                a - b for a, b in zip(row.samples_s, ddp.samples_s, strict=True)
            )
            parts.append(
                f"{label} {(row.median_s - ddp.median_s) / blocks * 1e6:.0f} "
                f"(paired {paired / blocks * 1e6:.0f})"
            )
        if parts:
            lines.append(
                f"per-module cost ({model}, {blocks} blocks), (step - DDP step) / blocks, "
                f"us: " + ", ".join(parts)
            )
    return lines


def header(args: argparse.Namespace, settings: TrainSettings, notes: list[str]) -> str:
    device = default_device()
    models = ", ".join(
        f"{m} (steps x repeats {args.steps or DEFAULT_SCHEDULE[m][0]}"
        f"x{args.repeats or DEFAULT_SCHEDULE[m][1]})"
        for m in _split(args.models)
    )
    lines = [
        f"zerodp {zerodp.__version__} step-time benchmark",
        f"torch {torch.__version__}, world size {dist.get_world_size()}, device {device.type}, "
        f"backend {dist.get_backend()}, intra-op threads per rank {torch.get_num_threads()}",
        f"dtype {args.dtype}, AdamW lr {settings.lr} weight_decay 0.0, warmup {args.warmup}, "
        f"seed {args.seed}",
        f"models: {models}",
        f"zero_optimization: reduce_bucket_size {settings.reduce_bucket_size}, overlap_comm "
        f"True, stage3_prefetch_bucket_size {settings.prefetch_bucket_size}, zerodp "
        f"stage3_unit_numel {settings.unit_numel}",
        *(
            f"{m}: micro-batch {s.micro_batch} per rank, stage3_param_persistence_threshold "
            f"{s.persistence_threshold}"
            for m, s in ((m, settings_for(m, settings, args)) for m in _split(args.models))
        ),
        *(f"note: {n}" for n in notes),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    settings = TrainSettings(
        micro_batch=GENERIC_DEFAULTS["micro_batch"],
        lr=args.lr,
        reduce_bucket_size=args.reduce_bucket_size,
        persistence_threshold=GENERIC_DEFAULTS["persistence_threshold"],
        prefetch_bucket_size=args.prefetch_bucket_size,
        dtype=args.dtype,
        unit_numel=args.unit_numel,
    )
    ensure_process_group()
    try:
        specs, notes = args.specs, []
        missing = (
            deepspeed_missing_reason() if any(s.engine == "deepspeed" for s in specs) else None
        )
        if missing is not None:
            specs = [s for s in specs if s.engine != "deepspeed"]
            notes.append(f"deepspeed skipped ({missing})")
        if is_rank0():
            print(header(args, settings, notes), flush=True)
        rows: list[Row] = []
        for name in _split(args.models):
            rows += bench_model(name, specs, settings, args)
        fill_ratios(rows)
        if is_rank0():
            print("\n" + format_table(rows) + "\n" + FOOTNOTE, flush=True)
            for line in variant_cost(rows) + per_module_cost(rows):
                print(line, flush=True)
            if args.json:
                write_json(args.json, rows, dist.get_world_size())
                print(f"rows written to {args.json}", flush=True)
        if args.profile_stage3:
            profile_stage3(args.profile_stage3, settings, args)
        dist.barrier()
    finally:
        destroy_process_group_if_owned()
    return 0


if __name__ == "__main__":
    sys.exit(main())
