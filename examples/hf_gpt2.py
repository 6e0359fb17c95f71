"""Train a HuggingFace GPT-2 with zerodp at ZeRO stage 3.

The model is third-party code zerodp knows nothing about: `GPT2LMHeadModel`
from `transformers`, built from a small `GPT2Config` with random weights (no
download), whose input and output embeddings are one tied Parameter. The
data are random token ids, so the loss only falls as the model learns the
unigram distribution; the point is the plumbing, not the language model.

    torchrun --standalone --nproc_per_node 2 examples/hf_gpt2.py
    python examples/hf_gpt2.py            # world size 1
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import zerodp
from zerodp.comm import destroy_process_group_if_owned

STEPS = 30
LOG_EVERY = 5
SEQ_LEN = 64
VOCAB = 512

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "zero_optimization": {
        "stage": 3,
        # Parameters with fewer elements than this stay whole on every rank
        # (biases, LayerNorms); larger ones are sharded and gathered on use.
        "stage3_param_persistence_threshold": 1_000,
    },
}


def build_model() -> GPT2LMHeadModel:
    """A tiny GPT-2, seeded identically on every rank (zerodp also broadcasts rank 0's)."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,  # the defaults (50256) lie outside this small vocabulary
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def random_batch(generator: torch.Generator) -> torch.Tensor:
    """Token ids drawn from a skewed distribution, so there is something to learn."""
    weights = torch.arange(VOCAB, 0, -1, dtype=torch.float).pow(2)
    batch = CONFIG["train_micro_batch_size_per_gpu"]
    ids = torch.multinomial(weights, batch * SEQ_LEN, replacement=True, generator=generator)
    return ids.view(batch, SEQ_LEN)


def main() -> None:
    transformers.logging.set_verbosity_error()  # quiet its notes about the default loss
    model = build_model()
    engine, _, _, _ = zerodp.initialize(model=model, config=CONFIG)
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for step in range(1, STEPS + 1):
        tokens = random_batch(generator)
        out = engine(input_ids=tokens, labels=tokens)  # GPT-2 shifts the labels itself
        engine.backward(out.loss)
        engine.step()
        if rank == 0 and (step == 1 or step % LOG_EVERY == 0):
            print(f"step {step:3d}  loss (rank 0) {out.loss.item():.4f}", flush=True)
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
