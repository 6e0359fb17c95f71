"""Shared by the tests of optimizers that read whole tensors (importable by worker processes).

`LayoutNet` is sized so that its flat layout has every case the tensor-wise step must handle
(`layout_facts` reads them from a real engine): in one flat group at world size 3 (528
elements, shards of 176) `proj.weight` (240) holds rank 0's shard wholly and straddles into
rank 1's, rank 2's shard holds only the 1-D `scale`, and `gain` and the biases lie between
matrices; at world size 2 `head.weight` straddles the boundary.

A `Recipe` is an optimizer as a user hands it to zerodp, and the same optimizer for the
single-process reference: torch's Adafactor; torch's Muon for the matrices with AdamW for the
rest, as a list; and the config's DeepSpeed-style "Muon".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import nn

import zerodp

MUON_LR, ADAMW_LR, ADAFACTOR_LR, WEIGHT_DECAY = 2e-3, 1e-2, 1e-2, 0.01


class LayoutNet(nn.Module):
    """Registration order puts `scale` last and `proj.weight` first in the flat buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(-1.0, 1.0, 176))
        self.a = nn.Linear(5, 6)
        self.gain = nn.Parameter(torch.ones(6))
        self.head = nn.Linear(6, 10)
        self.proj = nn.Linear(10, 24, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.gain
        y = self.proj(torch.tanh(self.head(h)))
        return torch.tanh(y[:, :8]) @ self.scale.view(8, 22)


def layout_inputs(rank: int, step: int, micro: int, batch: int = 4) -> torch.Tensor:
    """Different data on every rank, step and micro-batch."""
    generator = torch.Generator().manual_seed(7000 + 1000 * rank + 10 * step + micro)
    return torch.randn(batch, 5, generator=generator)


def layout_loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def matrices(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.ndim == 2]


def vectors(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.ndim != 2]


class Stepper:
    """One or several torch optimizers stepped together (the reference side of a recipe)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def state_of(self, param: nn.Parameter) -> dict[str, Any]:
        for optimizer in self.optimizers:
            if param in optimizer.state:
                return dict(optimizer.state[param])
        return {}


@dataclass(frozen=True)
class Recipe:
    name: str
    # What zerodp.initialize gets: (optimizer=, the config's "optimizer" entry or None).
    for_engine: Callable[[nn.Module], tuple[Any, dict[str, Any] | None]]
    # The same optimizer on a plain model's parameters.
    for_reference: Callable[[list[nn.Parameter]], Stepper]


def _adafactor_engine(model: nn.Module) -> tuple[Any, dict[str, Any] | None]:
    return torch.optim.Adafactor(model.parameters(), lr=ADAFACTOR_LR), None


def _adafactor_reference(params: list[nn.Parameter]) -> Stepper:
    return Stepper([torch.optim.Adafactor(params, lr=ADAFACTOR_LR)])


def _muon_pair(
    params: list[nn.Parameter],
    adam_betas: tuple[float, float] = (0.9, 0.999),
    adam_eps: float = 1e-8,
) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.Muon([p for p in params if p.ndim == 2], lr=MUON_LR, weight_decay=WEIGHT_DECAY),
        torch.optim.AdamW(
            [p for p in params if p.ndim != 2],
            lr=ADAMW_LR,
            weight_decay=WEIGHT_DECAY,
            betas=adam_betas,
            eps=adam_eps,
        ),
    ]


def _muon_list_engine(model: nn.Module) -> tuple[Any, dict[str, Any] | None]:
    return _muon_pair(list(model.parameters())), None


def _muon_list_reference(params: list[nn.Parameter]) -> Stepper:
    return Stepper(_muon_pair(params))


MUON_CONFIG = {
    "type": "Muon",
    "params": {"lr": MUON_LR, "adam_lr": ADAMW_LR, "weight_decay": WEIGHT_DECAY},
}


def _muon_config_engine(model: nn.Module) -> tuple[Any, dict[str, Any] | None]:
    return None, MUON_CONFIG


def _muon_config_reference(params: list[nn.Parameter]) -> Stepper:
    # DeepSpeed's auxiliary Adam defaults: betas (0.9, 0.95), eps 1e-10.
    return Stepper(_muon_pair(params, adam_betas=(0.9, 0.95), adam_eps=1e-10))


RECIPES = {
    "adafactor": Recipe("adafactor", _adafactor_engine, _adafactor_reference),
    "muon_list": Recipe("muon_list", _muon_list_engine, _muon_list_reference),
    "muon_config": Recipe("muon_config", _muon_config_engine, _muon_config_reference),
}


def newton_schulz_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration computed in fp32 instead of torch's bf16.

    torch's Muon casts the update to bf16 before orthogonalizing it, which turns any fp32
    round-off of the averaged gradient (its summation order: a different world size, or
    DDP's buckets) into a bf16 rounding flip of up to lr * 2**-8 in a weight. The parity
    tests run this fp32 iteration on both sides, so that 1e-6 measures zerodp and not the
    rounding; stock bf16 Muon is checked where the summation order is the reference's.
    """
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@contextmanager
def newton_schulz(precision: str, counter: list[int] | None = None) -> Iterator[None]:
    """Muon's Newton-Schulz in "bf16" (torch's own) or "fp32" (`newton_schulz_fp32`); every
    call is counted in `counter[0]` when given."""
    import torch.optim._muon as muon_module

    inner = muon_module._zeropower_via_newtonschulz if precision == "bf16" else newton_schulz_fp32

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        if counter is not None:
            counter[0] += 1
        return inner(*args, **kwargs)

    with mock.patch.object(muon_module, "_zeropower_via_newtonschulz", counted):
        yield


def layout_facts(engine: zerodp.ZeroEngine) -> dict[str, bool]:
    """What the engine's real flat layout holds, over every trainable group."""
    facts = {
        "straddles": False,
        "rank_inside": False,
        "rank_without_matrix": False,
        "vector_between": False,
    }
    world = engine.world_size
    for state in engine.groups.trainable:
        layout = state.flat.layout
        is_matrix = [len(slot.shape) == 2 for slot in layout.slots]
        positions = [i for i, m in enumerate(is_matrix) if m]
        if not positions:
            continue
        for i in positions:
            slot = layout.slots[i]
            facts["straddles"] |= len(layout.owners(i)) >= 2
            for rank in range(world):
                start, end = layout.shard_range(rank)
                facts["rank_inside"] |= slot.offset <= start and end <= slot.end
        for rank in range(world):
            facts["rank_without_matrix"] |= all(layout.overlap(i, rank) is None for i in positions)
        facts["vector_between"] |= any(not is_matrix[i] for i in range(positions[0], positions[-1]))
    return facts
