"""Tiny Hugging Face models of many families, built from config objects (no downloads).

Each entry builds a model with its family's usual `pad_token_id` (which makes
transformers zero the padding row of the embedding in `_init_weights`, the view
that used to crash `zero.Init`) and makes a small batch for it, different on
every rank and step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers as hf
from torch import nn

VOCAB = 97
_DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
_SEQ2SEQ = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
}


def _gpt2() -> nn.Module:
    config = hf.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return hf.GPT2LMHeadModel(config)


def _t5() -> nn.Module:
    config = hf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        pad_token_id=0, decoder_start_token_id=0,
    )  # fmt: skip
    return hf.T5ForConditionalGeneration(config)


def _vit() -> nn.Module:
    config = hf.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=3,
    )  # fmt: skip
    return hf.ViTForImageClassification(config)


def _whisper() -> nn.Module:
    config = hf.WhisperConfig(
        **_SEQ2SEQ, num_mel_bins=8, max_source_positions=16, max_target_positions=16,
        pad_token_id=0, decoder_start_token_id=1,
    )  # fmt: skip
    return hf.WhisperForConditionalGeneration(config)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": _gpt2,
    "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**_DECODER, num_key_value_heads=2)),
    "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(**_DECODER, num_key_value_heads=2)),
    "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**_DECODER, num_key_value_heads=2)),
    "gemma": lambda: hf.GemmaForCausalLM(
        hf.GemmaConfig(**_DECODER, num_key_value_heads=2, head_dim=8)
    ),
    "phi": lambda: hf.PhiForCausalLM(hf.PhiConfig(**_DECODER)),
    "bert": lambda: hf.BertForMaskedLM(hf.BertConfig(**_DECODER)),
    "roberta": lambda: hf.RobertaForMaskedLM(hf.RobertaConfig(**{**_DECODER, "pad_token_id": 1})),
    "t5": _t5,
    "bart": lambda: hf.BartForConditionalGeneration(
        hf.BartConfig(**_SEQ2SEQ, max_position_embeddings=64, pad_token_id=1)
    ),
    "vit": _vit,
    "whisper": _whisper,
}


def batch(name: str, rank: int, step: int) -> dict[str, Any]:
    """Inputs with labels for one micro-batch (2 samples), different per rank and step."""
    generator = torch.Generator().manual_seed(5000 + 100 * rank + step)
    if name == "vit":
        return {
            "pixel_values": torch.randn(2, 3, 16, 16, generator=generator),
            "labels": torch.randint(0, 3, (2,), generator=generator),
        }
    if name == "whisper":
        return {
            "input_features": torch.randn(2, 8, 32, generator=generator),
            "labels": torch.randint(3, VOCAB, (2, 6), generator=generator),
        }
    tokens = torch.randint(3, VOCAB, (2, 8), generator=generator)
    return {"input_ids": tokens, "labels": tokens.clone()}
