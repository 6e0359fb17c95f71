"""Train a byte-level Llama on long sequences, each split over the ranks (sequence parallelism).

    torchrun --standalone --nproc_per_node 2 examples/train_long_sequences.py

Every sequence (`--seq-len` bytes of the Python standard library's sources, as in the demo)
is split over `--sequence-parallel-size` ranks (default: all of them), so each rank's layers
hold 1/S of its activations, and ZeRO stage 3 shards the model over every rank. The training
loop is the one for any Hugging Face causal LM: `out = engine(input_ids=..., labels=...)`,
`engine.backward(out.loss)`, `engine.step()`; the engine splits the sequence, switches the
model's attention to sequence-parallel attention (two all-to-alls around the model's own
sdpa) and returns the whole sequence's loss. No network, no downloads. See
docs/sequence-parallel.md.
"""

from __future__ import annotations

import os

# Ranks on a small machine must not each spawn a thread per core; set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import zerodp  # noqa: E402
from examples.stdlib_text import load_corpus  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seq-len", type=int, default=2048, help="tokens (bytes) per sequence")
    p.add_argument("--sequence-parallel-size", type=int, default=0, help="0: the world size")
    p.add_argument("--stage", type=int, default=3, help="ZeRO stage")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per data rank")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2, help="grouped-query key/value heads")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--no-checkpointing", action="store_true", help="keep every activation")
    p.add_argument("--max-train-bytes", type=int, default=4 << 20)
    return p.parse_args(argv)


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """The corpus's windows as a causal LM's batch: the model shifts the labels itself."""

    def __init__(self, windows: Any) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens, _ = self.windows[index]
        return {"input_ids": tokens, "labels": tokens}


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    if not args.no_checkpointing:
        # transformers' current name; releases before it (5.18 and older) only have the one
        # it deprecates, `gradient_checkpointing_enable`, which does the same.
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    return model


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sequence = args.sequence_parallel_size or world
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "sequence_parallel_size": sequence,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10_000,
        "seed": 0,
    }
    corpus = load_corpus(
        args.seq_len, max_train_bytes=args.max_train_bytes, max_valid_bytes=args.seq_len + 1
    )
    model = build_model(args)
    engine, _, loader, _ = zerodp.initialize(
        model=model, config=config, training_data=Sequences(corpus.train)
    )
    seen: set[int] = set()
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, inputs, out: seen.add(int(inputs[0].shape[1])))
    rank = dist.get_rank()
    if rank == 0:
        print(
            f"{world} ranks: sequences of {args.seq_len} tokens split over {sequence} ranks "
            f"(sequence_parallel_size), {engine.data_parallel_size} data-parallel; ZeRO stage "
            f"{args.stage} shards the model over all {world}"
        )
    losses: list[float] = []
    started = time.perf_counter()
    while engine.global_steps < args.steps:
        for batch in loader:
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
            losses.append(float(out.loss.detach()))
            if rank == 0 and engine.global_steps % 5 == 0:
                print(f"step {engine.global_steps:4d}  loss {losses[-1]:.4f}")
            if engine.global_steps >= args.steps:
                break
    elapsed = time.perf_counter() - started
    tokens = args.steps * args.micro_batch * engine.data_parallel_size * args.seq_len
    summary = {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "layer_lengths": sorted(seen),
        "tokens_per_second": tokens / elapsed,
    }
    if rank == 0:
        speed = summary["tokens_per_second"]
        print(
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps; each rank's layers "
            f"saw {sorted(seen)} tokens of every {args.seq_len}; {speed:.0f} tokens/s"
        )
    engine.destroy()
    return summary


if __name__ == "__main__":
    main()
