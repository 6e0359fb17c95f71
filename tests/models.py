"""Small models shared by the tests (importable by the worker processes)."""

from __future__ import annotations

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
