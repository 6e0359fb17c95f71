"""Tiny Hugging Face mixture-of-experts models, built from configs (no download).

Each has 8 experts, top-2 routing, hidden size 32 and 2 decoder layers, as the
pinned transformers defines the architecture: Qwen3-MoE, Mixtral, OLMoE,
gpt-oss (expert biases, a clamped GLU, a router bias) and DeepSeek-V3 (a dense
first layer, shared experts, a grouped sigmoid router in fp32). `build(name)`
gives the same random model on every call with the same seed; gpt-oss's expert
biases (zeros at init) get random values so that their gradients are tested.
`token_batch` draws a rank's own batch of ids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 64
HIDDEN = 32
NUM_EXPERTS = 8
TOP_K = 2
SEQ_LEN = 8

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "num_experts_per_tok": TOP_K,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


def _qwen3_moe(implementation: str) -> nn.Module:
    config = Qwen3MoeConfig(
        **_COMMON,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=NUM_EXPERTS,
        norm_topk_prob=True,
        experts_implementation=implementation,
    )
    return Qwen3MoeForCausalLM(config)


def _mixtral(implementation: str) -> nn.Module:
    config = MixtralConfig(
        **_COMMON,
        intermediate_size=16,
        num_local_experts=NUM_EXPERTS,
        experts_implementation=implementation,
    )
    return MixtralForCausalLM(config)


def _olmoe(implementation: str) -> nn.Module:
    config = OlmoeConfig(
        **_COMMON,
        intermediate_size=16,
        num_experts=NUM_EXPERTS,
        experts_implementation=implementation,
    )
    return OlmoeForCausalLM(config)


def _gpt_oss(implementation: str) -> nn.Module:
    config = GptOssConfig(
        **_COMMON,
        head_dim=8,
        intermediate_size=16,
        num_local_experts=NUM_EXPERTS,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        experts_implementation=implementation,
    )
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_bias"):
                param.normal_(0.0, 0.1)
    return model


def _deepseek_v3(implementation: str) -> nn.Module:
    config = DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4},
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=NUM_EXPERTS,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        experts_implementation=implementation,
    )
    return DeepseekV3ForCausalLM(config)


BUILDERS: dict[str, Callable[[str], nn.Module]] = {
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
}
# The experts modules each architecture's own plan names (layer 0 of DeepSeek-V3 is dense).
EXPERT_LAYERS = {name: (0, 1) for name in BUILDERS} | {"deepseek_v3": (1,)}


def build(name: str, seed: int = 0, implementation: str = "grouped_mm") -> nn.Module:
    """The same random tiny model `name` on every call with the same seed, in fp32."""
    torch.manual_seed(seed)
    return BUILDERS[name](implementation).float()


def experts_of(model: nn.Module) -> list[nn.Module]:
    """The experts modules of `model`, in layer order."""
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts")]


def token_batch(rank: int, step: int = 0, batch: int = 2) -> torch.Tensor:
    """Rank `rank`'s own batch of ids (different on every rank)."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(3, VOCAB, (batch, SEQ_LEN), generator=generator)


def route_only_to(model: nn.Module, pairs: int) -> list[int]:
    """Set each MoE router so that only experts 0 .. 2 * pairs - 1 are ever chosen; returns
    the experts no token can reach.

    Experts 2j and 2j + 1 get router rows +s u_j and -s u_j (u_j a unit axis), the others
    zero rows: for every token one of each pair has a positive logit, so the top 2 are
    always two of them and never an expert whose logit is 0 (s is small enough that no
    probability underflows to the idle experts' in fp32).
    """
    with torch.no_grad():
        for name, module in model.named_modules():
            if not name.endswith("mlp.gate") and not name.endswith("mlp.router"):
                continue
            weight = module.weight
            weight.zero_()
            for j in range(pairs):
                weight[2 * j, j] = 4.0
                weight[2 * j + 1, j] = -4.0
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.zero_()
            correction = getattr(module, "e_score_correction_bias", None)
            if isinstance(correction, torch.Tensor):
                correction.zero_()
    return list(range(2 * pairs, NUM_EXPERTS))
