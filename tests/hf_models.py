"""Tiny Hugging Face models and locally generated data for the integration tests.

Shared by the Trainer, Lightning and Accelerate tests (importable by the worker
processes). The model is a 2-layer Llama built from a config (no download) with
tied input and output embeddings, so saving has a tied weight to write once;
its matrices are above the "auto" stage 3 persistence threshold (10 x hidden
size) and its norms below it, so stage 3 shards some parameters and keeps
others whole. The data are token ids drawn per index from a seeded generator:
every process builds the same dataset, and the samplers give each rank its part.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96
SEQ_LEN = 16
HIDDEN = 32
NUM_SAMPLES = 64


def build_llama(seed: int = 0) -> LlamaForCausalLM:
    """The same random tiny Llama on every call with the same seed."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config)


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """`NUM_SAMPLES` rows of random token ids; `labels` are the ids (the model shifts them)."""

    def __init__(self, num_samples: int = NUM_SAMPLES) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 + index)
        ids = torch.randint(3, VOCAB, (SEQ_LEN,), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()}


def probe_tokens() -> torch.Tensor:
    """A fixed batch to compare logits on."""
    generator = torch.Generator().manual_seed(7)
    return torch.randint(3, VOCAB, (2, SEQ_LEN), generator=generator)


def max_abs_difference(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> tuple[float, str]:
    """The largest elementwise difference over the shared names, and where it is."""
    if set(actual) != set(expected):
        raise AssertionError(f"names differ: {sorted(set(actual) ^ set(expected))}")
    worst, where = 0.0, ""
    for name, value in actual.items():
        diff = (value.float() - expected[name].float()).abs().max().item()
        if diff > worst or not where:
            worst, where = diff, name
    return worst, where


def fraction_above(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], threshold: float
) -> float:
    """The fraction of all elements that differ by more than `threshold`."""
    above, total = 0, 0
    for name, value in actual.items():
        diff = (value.float() - expected[name].float()).abs()
        above += int((diff > threshold).sum())
        total += diff.numel()
    return above / max(total, 1)


def detached(named: Any) -> dict[str, torch.Tensor]:
    """name -> a float32 CPU copy, from named_parameters() or a state dict's items()."""
    return {name: value.detach().float().cpu().clone() for name, value in named}
