"""Fine-tune a small Hugging Face causal LM with the HF Trainer and zerodp at ZeRO stage 3.

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py

`ZeroDPTrainer` is the `transformers.Trainer` with zerodp doing the training
step (zerodp/integrations/transformers.py). No downloads: the model is a
byte-level Llama built from a config (vocabulary 256, one token per byte, so
no tokenizer either), the text is the Python standard library's own source
files (examples/stdlib_text.py). The config is a DeepSpeed-style file with
"auto" values (examples/hf_trainer_zero3.json), filled from the
TrainingArguments as the Trainer's DeepSpeed integration would. Rank 0 shows
the Trainer's progress bar and logs (loss, grad_norm, learning_rate,
eval_loss); the run ends with `save_model`, a reload with
`AutoModelForCausalLM.from_pretrained` and a sample from the reloaded model.
`--resume` continues from the last `checkpoint-N` in `--output-dir`.
See examples/README.md.
"""

from __future__ import annotations

import os

# Two ranks on a small machine must not each spawn a thread per core; set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

_START = time.perf_counter()
_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from examples.stdlib_text import ByteWindows, load_corpus  # noqa: E402
from zerodp.integrations.transformers import ZeroDPTrainer  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", default=str(_HERE / "hf_trainer_zero3.json"), help="zerodp config")
    p.add_argument("--output-dir", default="runs/hf_trainer", help="checkpoints and the model")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="per-rank micro batch")
    p.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine schedule)")
    p.add_argument("--seq-len", type=int, default=128, help="context length in bytes")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    p.add_argument("--eval-windows", type=int, default=64, help="validation windows per eval")
    p.add_argument("--bf16", action="store_true", help="train in bf16 (fp32 master weights)")
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute activations in backward"
    )
    p.add_argument("--prompt", default="def ", help="prompt of the final sample")
    p.add_argument("--sample-bytes", type=int, default=120, help="bytes to generate")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and sampling")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    return p.parse_args(argv)


class CausalLMWindows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Byte windows as the Trainer feeds a causal LM: `labels` are the ids (the model shifts)."""

    def __init__(self, windows: ByteWindows, limit: int | None = None) -> None:
        self.windows = windows
        self.size = len(windows) if limit is None else min(limit, len(windows))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # Evenly spread when limited, so validation covers the whole held-out text.
        inputs, _ = self.windows[index * len(self.windows) // self.size]
        return {"input_ids": inputs, "labels": inputs.clone()}


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)  # the same initial weights on every rank (zerodp takes rank 0's)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        bos_token_id=10,  # bytes: newline and NUL, so generate() has ids it can use
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def training_arguments(args: argparse.Namespace) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,  # a ratio of the run
        weight_decay=0.1,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        bf16=args.bf16,
        activation_checkpointing=args.activation_checkpointing,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        save_strategy="steps",
        save_steps=args.eval_every,
        save_total_limit=1,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
    )


def sample(model_dir: str, prompt: str, num_bytes: int, seed: int) -> str:
    """Generate from the saved model, reloaded as a plain HF model (rank 0 only)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    ids = torch.tensor([list(prompt.encode())])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_bytes,
            do_sample=True,
            temperature=0.8,
            top_k=40,
        )
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    transformers.logging.set_verbosity_warning()
    corpus = load_corpus(args.seq_len, max_train_bytes=4 << 20, max_valid_bytes=512 << 10)
    train, valid = CausalLMWindows(corpus.train), CausalLMWindows(corpus.valid, args.eval_windows)
    model = build_model(args)
    trainer = ZeroDPTrainer(
        model=model,
        args=training_arguments(args),
        train_dataset=train,
        eval_dataset=valid,
        zerodp_config=args.config,
    )
    first = trainer.args.process_index == 0
    if first:
        params = sum(p.numel() for p in model.parameters())
        print(
            f"{corpus.train_files} files / {corpus.train_bytes:,} bytes of training text, "
            f"{len(valid)} validation windows; Llama with {params:,} parameters; "
            f"{trainer.args.world_size} ranks",
            flush=True,
        )
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)  # every rank: the weights are gathered from the shards
    engine = trainer.engine
    assert engine is not None
    if first:
        print(
            f"\nZeRO stage {engine.zero_optimization_stage()} on {engine.world_size} ranks: "
            f"train loss {result.training_loss:.3f} (mean over the run), eval loss "
            f"{metrics['eval_loss']:.3f} nats/byte (ln 256 = 5.545), "
            f"{time.perf_counter() - _START:.0f} s in all",
        )
        print(f"saved to {final} (config.json + model.safetensors); a sample from it:\n")
        print(sample(final, args.prompt, args.sample_bytes, args.seed), flush=True)


if __name__ == "__main__":
    main()
