"""`GenerationRoute`: the trainer's `model.generate` entering `engine.gathered_for_generation()`.

The route's own bookkeeping, on an engine stand-in that records each entry of
the context (the real context on TRL's GRPO at stage 3, gathers counted, is
`tests/distributed/test_trl.py`): one entry per call, none for a call made
inside a block the caller opened, and `remove()` puts back exactly what was there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")


class Generating(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def generate(self, prompt: torch.Tensor, *, tokens: int = 1) -> str:
        """The model's own generate."""
        return f"class:{tokens}"


class FakeEngine:
    """What the route reads: the stage, the context, and whether it is open."""

    def __init__(self, stage: int = 3) -> None:
        self.stage = stage
        self.generation_block_open = False
        self.entries = 0

    def zero_optimization_stage(self) -> int:
        return self.stage

    @contextlib.contextmanager
    def gathered_for_generation(self) -> Iterator[None]:
        assert not self.generation_block_open, "the context does not nest"
        self.entries += 1
        self.generation_block_open = True
        try:
            yield
        finally:
            self.generation_block_open = False


def route(model: nn.Module, engine: FakeEngine, **args: Any) -> Any:
    from zerodp.integrations.post_training import route_generation

    return route_generation(model, engine, SimpleNamespace(**args))  # type: ignore[arg-type]


def test_each_call_enters_the_context_once_and_remove_restores_the_method() -> None:
    model, engine = Generating(), FakeEngine()
    seen: list[bool] = []
    inner = Generating.generate

    def spying(self: Generating, prompt: torch.Tensor, *, tokens: int = 1) -> str:
        seen.append(engine.generation_block_open)
        return inner(self, prompt, tokens=tokens)

    Generating.generate = spying  # type: ignore[method-assign]
    try:
        routed = route(model, engine)
        assert routed is not None and model.generate.__doc__ == spying.__doc__
        assert model.generate(torch.zeros(1), tokens=3) == "class:3"
        assert model.generate(torch.zeros(1)) == "class:1"
        assert (engine.entries, seen) == (2, [True, True])
        with engine.gathered_for_generation():  # opened by the caller: no second entry
            assert model.generate(torch.zeros(1)) == "class:1"
        assert engine.entries == 3 and seen == [True, True, True]
        routed.remove()
        assert "generate" not in vars(model)
        model.generate(torch.zeros(1))
        assert engine.entries == 3 and seen[-1] is False
    finally:
        Generating.generate = inner  # type: ignore[method-assign]


def test_remove_puts_back_a_function_set_on_the_instance() -> None:
    model, engine = Generating(), FakeEngine()

    def own(prompt: torch.Tensor) -> str:
        return "own"

    model.generate = own  # type: ignore[method-assign]
    routed = route(model, engine)
    assert model.generate(torch.zeros(1)) == "own" and engine.entries == 1
    routed.remove()
    assert vars(model)["generate"] is own


def test_remove_leaves_a_newer_replacement_in_place() -> None:
    model, engine = Generating(), FakeEngine()
    routed = route(model, engine)

    def newer(prompt: torch.Tensor) -> str:
        return "newer"

    model.generate = newer  # type: ignore[method-assign]
    routed.remove()
    assert vars(model)["generate"] is newer


def test_no_route_below_stage_3_when_trl_asks_not_to_gather_or_without_generate() -> None:
    assert route(Generating(), FakeEngine(stage=1)) is None
    assert route(Generating(), FakeEngine(), ds3_gather_for_generation=False) is None
    assert route(nn.Linear(2, 2), FakeEngine()) is None
    model = Generating()
    assert route(model, FakeEngine(), ds3_gather_for_generation=True) is not None
