"""Models whose ranks take different paths: a routed mixture of experts, a branch some ranks skip.

`MoELM` is a small decoder-only transformer whose feed-forward layers are top-k routed
mixtures of experts (`MoEBlock`: a router and experts as separate modules, no capacity
limit, so no token is dropped). An expert that gets no token does not run, so ranks whose
data routes differently run different experts, and experts nobody routed to in a step run
nowhere. `VisionLM` runs its vision tower only when the batch has images: ranks whose
batches have none skip it. Both record what they ran (`MoEBlock.last_counts`,
`Embedder.ran_vision`) so that a test can assert that its data really took different
paths on different ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.models import CausalSelfAttention, TinyGPTConfig


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoEBlock(nn.Module):
    """Top-k routing over separate expert modules; an expert with no token is skipped."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))
        self.last_counts: list[int] = [0] * num_experts  # tokens per expert, last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        counts = []
        for index, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == index)
            counts.append(int(token.numel()))
            if token.numel() == 0:
                continue
            contribution = expert(flat[token]) * weights[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, contribution)
        self.last_counts = counts
        return out.reshape(x.shape)


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 32
    seq_len: int = 4
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 16
    d_expert: int = 24
    num_experts: int = 8
    top_k: int = 2


class MoETransformerBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        attn_cfg = TinyGPTConfig(
            vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, n_head=cfg.n_head, d_model=cfg.d_model
        )
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(attn_cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoEBlock(cfg.d_model, cfg.d_expert, cfg.num_experts, cfg.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoELM(nn.Module):
    """A decoder-only MoE transformer; `checkpoint` ("reentrant"/"nonreentrant") per block."""

    def __init__(self, cfg: MoEConfig, checkpoint: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(MoETransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            if self.checkpoint is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
        return self.head(self.ln_f(x))

    def moe_blocks(self) -> list[MoEBlock]:
        return [block.moe for block in self.blocks]


def moe_inputs(rank: int, step: int, cfg: MoEConfig, batch: int = 1) -> torch.Tensor:
    """Tokens from a slice of the vocabulary that depends on the rank, so routing differs."""
    generator = torch.Generator().manual_seed(11_000 + 1000 * rank + step)
    width = cfg.vocab_size // 4
    low = (rank * width) % cfg.vocab_size
    return torch.randint(low, low + width, (batch, cfg.seq_len), generator=generator)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of `logits` over `tokens` (the last position predicts nothing)."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
    )


# -- a branch only some ranks take ---------------------------------------------------------


class VisionTower(nn.Module):
    def __init__(self, patch_dim: int, dim: int) -> None:
        super().__init__()
        self.patch = nn.Linear(patch_dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.patch(images))


class Embedder(nn.Module):
    """Token embeddings, plus the vision tower's image features when the batch has images."""

    def __init__(self, vocab: int, patch_dim: int, dim: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.vision = VisionTower(patch_dim, dim)
        self.ran_vision = False

    def forward(self, tokens: torch.Tensor, images: torch.Tensor | None) -> torch.Tensor:
        h = self.tokens(tokens)
        self.ran_vision = images is not None
        if images is not None:
            h = h + self.vision(images).mean(dim=1, keepdim=True)
        return h


class VisionLM(nn.Module):
    """A small language model with a vision tower that runs only for batches with images."""

    def __init__(self, vocab: int = 24, patch_dim: int = 12, dim: int = 16) -> None:
        super().__init__()
        self.embed = Embedder(vocab, patch_dim, dim)
        self.body = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, images: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens, images)
        return self.head(self.norm(h + self.body(h)))


def vision_inputs(
    rank: int, step: int, with_images: bool, vocab: int = 24, patch_dim: int = 12, batch: int = 2
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens, images or None): images only where `with_images`."""
    generator = torch.Generator().manual_seed(21_000 + 1000 * rank + step)
    tokens = torch.randint(0, vocab, (batch, 6), generator=generator)
    images = torch.randn(batch, 3, patch_dim, generator=generator) if with_images else None
    return tokens, images


# -- top-1 routing between two experts of one shape ----------------------------------------


class TopOneBlock(nn.Module):
    """The whole batch goes to one of two experts of one shape, by the router's mean logit."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, 2)
        with torch.no_grad():  # the route starts out following the sign of the data
            self.router.weight.copy_(torch.tensor([[0.5], [-0.5]]).expand(2, dim))
            self.router.bias.zero_()
        self.expert = nn.Linear(dim, dim)
        self.expert_b = nn.Linear(dim, dim)
        self.last_choice = -1

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.router(h)
        self.last_choice = int(logits.mean(dim=0).argmax())
        chosen = self.expert if self.last_choice == 0 else self.expert_b
        return chosen(h) * logits.softmax(dim=-1)[:, self.last_choice : self.last_choice + 1]


class TwoExpertNet(nn.Module):
    """The issue's case: ranks whose data routes to different experts of one shape."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.block = TopOneBlock(dim)
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.block(x)))


def two_expert_inputs(rank: int, step: int, dim: int = 8, batch: int = 4) -> torch.Tensor:
    """Inputs shifted by rank (+3 on even ranks, -3 on odd ones), so routing differs."""
    generator = torch.Generator().manual_seed(31_000 + 1000 * rank + step)
    shift = 3.0 if rank % 2 == 0 else -3.0
    return torch.randn(batch, dim, generator=generator) + shift


# -- a module that uses one of its own parameters on some ranks only -------------------------


class Gated(nn.Module):
    """Two weights in one module (one stage 3 group); the second is used only when asked."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.extra = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, h: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = h @ self.weight
        return out + h @ self.extra if use_extra else out


class GatedNet(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.gated = Gated(dim)
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        return self.out(torch.tanh(self.gated(torch.tanh(self.inp(x)), use_extra)))
