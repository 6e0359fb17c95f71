"""Small models shared by the tests (importable by the worker processes)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class TinyNet(nn.Module):
    """170 parameters: divisible by 2, not by 3, so shards get padded at world size 3."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 11)
        self.norm = nn.LayerNorm(11)
        self.fc2 = nn.Linear(11, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class DropoutNet(nn.Module):
    """TinyNet with dropout, so that resuming must also restore the random generators."""

    def __init__(self) -> None:
        super().__init__()
        self.body = TinyNet()
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.drop(x))


class TiedLM(nn.Module):
    """Input and output embeddings tied (the same Parameter registered in two modules)."""

    def __init__(self, vocab: int = 13, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


class FunctionalTiedLM(nn.Module):
    """The output layer reads the embedding's weight directly (a parent using a child's param)."""

    def __init__(self, vocab: int = 13, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.relu(self.body(self.embed(tokens))), self.embed.weight)


class SharedBlockNet(nn.Module):
    """One submodule called twice in a forward, inside nested containers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.shared = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.stack = nn.ModuleList(
            [nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.LayerNorm(8)}) for _ in range(2)]
        )
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.inp(x))
        for block in self.stack:
            h = h + block["b"](block["a"](h))
        h = self.shared(h)
        return self.out(h)


def tiny_inputs(rank: int, step: int, batch: int = 4) -> torch.Tensor:
    """Different data on every rank and step (identical data would hide a missing reduction)."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(batch, 7, generator=generator)


def token_inputs(rank: int, step: int, vocab: int = 13, batch: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, vocab, (batch, 5), generator=generator)


def shared_block_inputs(rank: int, step: int, batch: int = 3) -> torch.Tensor:
    """SharedBlockNet's inputs, different on every rank and step."""
    generator = torch.Generator().manual_seed(3000 + 1000 * rank + step)
    return torch.randn(batch, 5, generator=generator)


class LifecycleNet(nn.Module):
    """Modules for every backward pattern: a checkpointable middle, a frozen and an unused layer."""

    def __init__(self, checkpoint: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor, use_unused: bool = False) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if self.checkpoint is None:
            h = self.mid(h)
        else:
            from torch.utils.checkpoint import checkpoint

            reentrant = self.checkpoint == "reentrant"
            h = checkpoint(self.mid, h, use_reentrant=reentrant)
        h = self.frozen(h) + h
        if use_unused:
            h = self.unused(h)
        return self.out(h)


def lifecycle_inputs(rank: int, step: int, batch: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7000 + 1000 * rank + step)
    return torch.randn(batch, 6, generator=generator)


# -- a small GPT ---------------------------------------------------------------------------
# The tests' own copy of the demo's architecture (examples/gpt.py), kept here so the tests do
# not depend on the examples: pre-norm blocks, learned positions, and input and output
# embeddings tied (one Parameter registered in `tok_emb` and `head`, used twice per pass).


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab_size: int = 64
    seq_len: int = 16
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        shape = (batch, seq, self.n_head, dim // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class GPTBlock(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer whose output layer is its input embedding (tied)."""

    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for `tokens` of shape (batch, seq)."""
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
