"""`engine.join()`: ranks with different numbers of batches train to the end, exactly.

Rank r has its own number of batches. Inside the join context a rank that runs out repeats
the other ranks' rounds with zero gradients ([Note: joining uneven inputs]). The reference,
computed in the test on every rank from every rank's batches: in round i the ranks that
still have a batch contribute their gradients, divided by the initial world size
(`divide_by_initial_world_size=True`, DDP's default) or by the number of those ranks, summed
over the accumulation window, then torch's AdamW steps, once per window, on every rank.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs
from zerodp.utils import safe_get_full_fp32_param

LR = 1e-2
COUNTS = {2: [5, 3], 3: [4, 2, 3], 4: [4, 2, 3, 1]}  # batches per rank


def _reference(counts: list[int], gas: int, divide_by_initial: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    kept = [torch.zeros_like(p) for p in model.parameters()]
    for step in range(max(counts)):
        training = [rank for rank, count in enumerate(counts) if step < count]
        divisor = len(counts) if divide_by_initial else len(training)
        for rank in training:
            model.zero_grad()
            model(tiny_inputs(rank, step)).square().mean().backward()
            for k, p in zip(kept, model.parameters(), strict=True):
                k.add_(p.grad / (divisor * gas))
        if (step + 1) % gas == 0:
            for k, p in zip(kept, model.parameters(), strict=True):
                p.grad = k.clone()
                k.zero_()
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def join_matches_the_reference(
    stages: list[int], zero: dict[str, Any] | None = None
) -> dict[str, float]:
    """The largest weight difference per case; `zero` adds zero_optimization keys (shard
    groups: `tests/distributed/test_hybrid.py`)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    counts = COUNTS[world_size]
    errors = {}
    for stage, gas, divide in itertools.product(stages, (1, 2), (True, False)):
        torch.manual_seed(0)
        model = TinyNet()
        config = zerodp_config(
            stage,
            gas=gas,
            optimizer=optimizer_config("AdamW", lr=LR, weight_decay=0.0),
            persistence_threshold=0,
            zero=zero or {},
        )
        engine, _, _, _ = zerodp.initialize(model=copy.deepcopy(model), config=config)
        with engine.join(divide_by_initial_world_size=divide):
            for step in range(counts[rank]):
                engine.backward(engine(tiny_inputs(rank, step)).square().mean())
                engine.step()
        assert engine.micro_steps == max(counts)  # the rounds of the longest rank, everywhere
        got = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
        want = _reference(counts, gas, divide)
        errors[f"stage {stage} gas {gas} divide_by_initial {divide}"] = max(
            (g - w).abs().max().item() for g, w in zip(got, want, strict=True)
        )
        engine.destroy()
    return errors


@pytest.mark.parametrize(("world_size", "stages"), [(2, [0, 1, 2, 3]), (3, [1, 3])])
def test_ranks_that_run_out_shadow_the_others_exactly(pools, world_size, stages) -> None:
    results = pools(world_size).run(join_matches_the_reference, stages, timeout_s=600)
    for errors in results:
        assert errors and all(error < 1e-6 for error in errors.values()), errors
