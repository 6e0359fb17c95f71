"""A compact mixture-of-experts GPT: `examples.gpt`'s blocks with top-k routed experts.

Each block's feed-forward layer is an `MoE`: a router (one linear layer) picks `top_k`
experts per token, and each expert is its own small MLP module. There is no capacity limit
(no token is dropped), and an expert that no token was routed to does not run, so ranks
whose data routes differently run different experts. At ZeRO stage 3 that is only
possible with each `MoE` marked as a leaf (`LEAF_CLASSES`, see docs/stage3.md):

    zerodp.zero.set_z3_leaf_modules(model, MoEGPT.LEAF_CLASSES)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt import CausalSelfAttention, GPTConfig


@dataclass(frozen=True)
class MoEGPTConfig(GPTConfig):
    num_experts: int = 8
    top_k: int = 2
    d_expert: int = 512  # each expert's hidden width


class Expert(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-k routing over separate expert modules; `last_counts` are the tokens per expert."""

    def __init__(self, cfg: MoEGPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(cfg.d_model, cfg.d_expert) for _ in range(cfg.num_experts)
        )
        self.last_counts = [0] * cfg.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        counts = []
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            counts.append(int(token.numel()))
            if token.numel():
                out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        self.last_counts = counts
        return out.reshape(x.shape)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEGPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoEGPT(nn.Module):
    """Decoder-only, learned positions, input and output embeddings tied (as `examples.gpt`)."""

    LEAF_CLASSES: tuple[type[nn.Module], ...] = (MoE,)

    def __init__(self, cfg: MoEGPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def idle_experts(self) -> int:
        """Experts that got no token in the last forward, over all blocks."""
        return sum(n == 0 for block in self.blocks for n in block.moe.last_counts)
