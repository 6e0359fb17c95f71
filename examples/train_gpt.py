"""Train a small byte-level GPT on the Python standard library with zerodp (ZeRO stage 3).

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --config examples/gpt_zero3.json

This is what `make demo` runs. It needs no network: the text is the `*.py`
sources of the interpreter's own standard library. Rank 0 shows a progress
bar and validation losses, then a generated sample, a summary table (model
state per rank against DDP), and a loss-curve plot next to the engine's CSV
logs; every rank saves its part of a checkpoint that `--resume` continues.
See examples/README.md.
"""

from __future__ import annotations

import os

# Two ranks on a small machine must not each spawn a thread per core; set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_START = time.perf_counter()
_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import zerodp  # noqa: E402
from examples.demo_eval import eval_indices, evaluate, generate, mean_over_ranks  # noqa: E402
from examples.demo_report import RunStats, plot_losses, summary_table  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.stdlib_text import ByteWindows, Corpus, load_corpus  # noqa: E402
from zerodp.monitor import TRAIN_LOSS, csv_file_name, log_dir  # noqa: E402

DEFAULT_STEPS = 800  # used only when the config has no scheduler to take the step count from


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Every knob of the demo; the defaults are tuned for ~3 minutes on 2 CPU cores."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", default=str(_HERE / "gpt_zero3.json"), help="zerodp JSON config")
    model = p.add_argument_group("model")
    model.add_argument("--n-layer", type=int, default=3, help="transformer blocks")
    model.add_argument("--d-model", type=int, default=96, help="embedding width")
    model.add_argument("--n-head", type=int, default=4, help="attention heads")
    model.add_argument("--seq-len", type=int, default=128, help="context length in bytes")
    train = p.add_argument_group("training")
    train.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps; default: the config's scheduler total_num_steps "
        "(the scheduler is re-fitted to any other value)",
    )
    train.add_argument("--seed", type=int, default=0, help="seed of the model init and sampling")
    train.add_argument(
        "--max-train-bytes", type=int, default=8 << 20, help="bytes of training text read"
    )
    train.add_argument(
        "--max-valid-bytes", type=int, default=1 << 20, help="bytes of validation text read"
    )
    evals = p.add_argument_group("evaluation and sampling")
    evals.add_argument(
        "--eval-every",
        type=int,
        default=50,
        help="steps between evaluations (0: only before the first and after the last step)",
    )
    evals.add_argument(
        "--eval-windows", type=int, default=128, help="validation windows per evaluation"
    )
    evals.add_argument("--prompt", default="def ", help="prompt of the final sample")
    evals.add_argument("--sample-bytes", type=int, default=200, help="bytes to generate")
    evals.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature; 0 is greedy (a model this small collapses into runs of "
        "spaces below ~0.8)",
    )
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--save-dir", default="checkpoints/gpt_zero3", help="checkpoint folder")
    ckpt.add_argument(
        "--save-every", type=int, default=0, help="also save every N steps (0: only at the end)"
    )
    ckpt.add_argument("--resume", action="store_true", help="continue from --save-dir's latest")
    ckpt.add_argument("--no-save", action="store_true", help="do not write any checkpoint")
    return p.parse_args(argv)


def load_config(path: str, steps: int | None) -> tuple[dict[str, Any], int]:
    """The JSON config as a dict with the scheduler fitted to `steps`, and the step count.

    The cosine schedule must end where training ends, so a `--steps` other
    than the config's `total_num_steps` patches it (and shortens the warm-up
    if it would no longer fit).
    """
    with open(path, encoding="utf-8") as handle:
        config: dict[str, Any] = json.load(handle)
    params = (config.get("scheduler") or {}).get("params")
    if params is None or "total_num_steps" not in params:
        return config, steps or DEFAULT_STEPS
    if steps is None:
        return config, int(params["total_num_steps"])
    config = copy.deepcopy(config)
    params = config["scheduler"]["params"]
    params["total_num_steps"] = max(steps, 2)
    if params.get("warmup_num_steps", 1000) >= params["total_num_steps"]:
        params["warmup_num_steps"] = max(1, params["total_num_steps"] // 10)
    return config, steps


def rank0_print(engine: zerodp.ZeroEngine, message: str) -> None:
    """Print on rank 0 only, through tqdm so an open progress bar is not torn."""
    if engine.global_rank == 0:
        tqdm.write(message)


def new_history(total_steps: int) -> dict[str, Any]:
    """What the summary and the plot need across a resume; saved as the checkpoint's client state.

    Plain lists, ints and floats only, so any checkpoint format can hold it.
    """
    return {
        "step": 0,
        "valid": [],
        "first_train_loss": None,
        "recent_train": [],
        "total_steps": total_steps,
    }


def record_train_loss(history: dict[str, Any], loss: float) -> None:
    """Keep the first loss and a short tail: one step's loss is too noisy to report alone."""
    if history["first_train_loss"] is None:
        history["first_train_loss"] = loss
    history["recent_train"] = [*history["recent_train"], loss][-10:]


def run_eval(
    engine: zerodp.ZeroEngine, valid: ByteWindows, indices: list[int], hist: dict[str, Any]
) -> None:
    """Evaluate (a collective: every rank calls it), record the point and show it on rank 0."""
    loss = evaluate(engine, valid, indices)
    hist["valid"].append([hist["step"], loss])
    rank0_print(engine, f"step {hist['step']:>5}: validation loss {loss:.4f}")


def save(engine: zerodp.ZeroEngine, args: argparse.Namespace, history: dict[str, Any]) -> str:
    """Save a checkpoint on every rank (each writes its own shards); returns where, for the log."""
    if args.no_save:
        return "not saved (--no-save)"
    state = {"step": history["step"], "history": history}
    return engine.save_checkpoint(args.save_dir, client_state=state)


def resume(engine: zerodp.ZeroEngine, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """Load the latest checkpoint; the engine restores model, optimizer, scheduler and loader.

    A missing or unreadable checkpoint is an error on every rank alike (the
    engine agrees on it before any collective), so nothing is caught here.
    """
    path, client_state = engine.load_checkpoint(args.save_dir)
    history = dict(client_state.get("history") or new_history(steps))
    history["step"] = int(client_state["step"])
    rank0_print(engine, f"resumed from {path} at step {history['step']}")
    saved_steps = history.get("total_steps", steps)
    if saved_steps != steps:
        rank0_print(
            engine,
            f"note: the learning-rate schedule restored from the checkpoint was fitted to "
            f"{saved_steps} steps, not --steps {steps}",
        )
    return history


def train_micro_batch(engine: zerodp.ZeroEngine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward, backward and `engine.step()` (which steps the optimizer only at a boundary)."""
    logits = engine(x.to(engine.device))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(engine.device).reshape(-1))
    engine.backward(loss)
    engine.step()
    return loss.detach()


def train(
    engine: zerodp.ZeroEngine,
    loader: Any,
    corpus: Corpus,
    args: argparse.Namespace,
    steps: int,
    history: dict[str, Any],
) -> tuple[float, int]:
    """Run optimizer steps until `steps`; returns (seconds spent in steps, tokens trained).

    Evaluation time is excluded from the throughput. The loss shown is the
    mean over ranks, so it does not depend on which rank prints it.
    """
    indices = eval_indices(corpus.valid, args.eval_windows, engine.global_rank, engine.world_size)
    if not history["valid"]:
        run_eval(engine, corpus.valid, indices, history)
    tokens_per_step = engine.train_batch_size() * args.seq_len
    bar = tqdm(
        total=steps,
        initial=history["step"],
        unit="step",
        disable=engine.global_rank != 0,
        dynamic_ncols=True,
    )
    train_s, done, window = 0.0, 0, []
    while history["step"] < steps:
        for x, y in loader:
            tic = time.perf_counter()
            boundary = engine.is_gradient_accumulation_boundary()
            window.append(train_micro_batch(engine, x, y))
            if boundary:
                loss_value = mean_over_ranks(torch.stack(window).mean())
                window = []
            train_s += time.perf_counter() - tic
            if not boundary:
                continue
            history["step"] += 1
            done += 1
            record_train_loss(history, loss_value)
            bar.set_postfix(
                loss=f"{loss_value:.3f}", tok_s=f"{done * tokens_per_step / train_s:,.0f}"
            )
            bar.update(1)
            step = history["step"]
            if (args.eval_every and step % args.eval_every == 0) or step == steps:
                run_eval(engine, corpus.valid, indices, history)
            if args.save_every and step % args.save_every == 0 and step < steps:
                rank0_print(engine, f"checkpoint: {save(engine, args, history)}")
            if step >= steps:
                break
    bar.close()
    return train_s, done * tokens_per_step


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    config, steps = load_config(args.config, args.steps)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    corpus = load_corpus(
        args.seq_len,
        max_train_bytes=args.max_train_bytes,
        max_valid_bytes=args.max_valid_bytes,
        seed=args.seed,
    )
    gpt_config = GPTConfig(
        seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model
    )
    model = GPT(gpt_config)
    num_params = model.num_params()
    engine, _, loader, _ = zerodp.initialize(model=model, config=config, training_data=corpus.train)
    rank0_print(
        engine,
        f"data: {corpus.train_files} train files ({corpus.train_bytes / 2**20:.1f} MiB read, "
        f"{len(corpus.train):,} windows), {corpus.valid_files} validation files "
        f"({corpus.valid_bytes / 2**20:.1f} MiB read)\n"
        f"model: GPT {args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, "
        f"context {args.seq_len}, {num_params:,} parameters\n"
        f"zerodp: stage {engine.zero_stage}, world size {engine.world_size}, device "
        f"{engine.device}, {engine.train_batch_size()} sequences per step, {steps} steps",
    )
    history = resume(engine, args, steps) if args.resume else new_history(steps)
    train_s, tokens = train(engine, loader, corpus, args, steps, history)
    checkpoint = save(engine, args, history)

    sample = generate(
        engine, args.prompt.encode(), args.sample_bytes, args.seq_len, args.temperature, args.seed
    )
    rank0_print(engine, "\n--- sample ---\n" + sample.decode("utf-8", errors="replace"))
    rank0_print(engine, "--- end of sample ---\n")
    recent = history["recent_train"]
    stats = RunStats(
        stage=engine.zero_stage,
        world_size=engine.world_size,
        num_params=num_params,
        state_bytes=engine.model_state_bytes(),
        first_train_loss=history["first_train_loss"] or float("nan"),
        final_train_loss=sum(recent) / len(recent) if recent else float("nan"),
        first_valid_loss=history["valid"][0][1],
        final_valid_loss=history["valid"][-1][1],
        wall_s=time.perf_counter() - _START,
        train_s=train_s,
        train_tokens=tokens,
        checkpoint=checkpoint,
    )
    rank0_print(engine, summary_table(stats))
    samples_per_step = engine.train_batch_size()
    engine.destroy()  # closes the engine's CSV logs, so the plot below reads complete files
    if engine.global_rank == 0:
        job = log_dir(config["csv_monitor"]["output_path"], config["csv_monitor"]["job_name"])
        note = plot_losses(
            job / csv_file_name(TRAIN_LOSS),
            [(s, v) for s, v in history["valid"]],
            samples_per_step,
            job / "loss_curve.png",
        )
        print(note, flush=True)
    zerodp.comm.destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
