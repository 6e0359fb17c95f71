"""Resuming an optimizer that reads whole tensors at another world size.

Two optimizer steps at one world size, a checkpoint, a fresh engine at another world size (and
stage) that loads it, two more steps: the weights and the optimizer state (Muon's momentum,
Adafactor's factored moments, AdamW's moments) must equal the uninterrupted run of the same
torch optimizer in one process on the same global batches, computed in the test, within 1e-6.
The whole-tensor state is saved by parameter name from the rank that stepped each tensor and
loaded by whichever rank steps it after the load, so this exercises moving it between owners.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.configs import zerodp_config
from tests.tensorwise_setup import RECIPES, LayoutNet, layout_loss, newton_schulz

GLOBAL_BATCH = 12  # 6 per rank at world size 2, 4 at world size 3
TOLERANCE = 1e-6
RECIPE_NAMES = ("muon_list", "adafactor")
# (world size, stage) that saves, then (world size, stage) that loads
SCENARIOS = {"2to3": ((2, 3), (3, 3)), "3to2": ((3, 1), (2, 2))}


def global_batch(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, 5, generator=torch.Generator().manual_seed(500 + step))


def _engine(recipe_name: str, stage: int) -> zerodp.ZeroEngine:
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    model = LayoutNet()
    optimizer, config_entry = recipe.for_engine(model)
    config = zerodp_config(
        stage,
        micro_batch=GLOBAL_BATCH // dist.get_world_size(),
        optimizer=config_entry,
        persistence_threshold=0,
    )
    engine, _, _, _ = zerodp.initialize(model=model, config=config, optimizer=optimizer)
    return engine


def _train(engine: zerodp.ZeroEngine, steps: range) -> None:
    rank, per_rank = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    for step in steps:
        x = global_batch(step)[rank * per_rank : (rank + 1) * per_rank]
        engine.backward(layout_loss(engine(x)))
        engine.step()


def save_after_two_steps(recipe_name: str, stage: int, directory: str) -> dict[str, Any]:
    """Save at step 2; then, in the same engine, a third step, a load of step 2 into the
    optimizer state it has (in place), and steps 3 and 4 again."""
    with newton_schulz("fp32"):
        engine = _engine(recipe_name, stage)
        _train(engine, range(2))
        engine.save_checkpoint(directory, tag="step2")
        _train(engine, range(2, 3))
        engine.load_checkpoint(directory, tag="step2")
        _train(engine, range(2, 4))
        result = _compare(engine, recipe_name)
        engine.destroy()
    return result


def resume_and_compare(recipe_name: str, stage: int, directory: str) -> dict[str, Any]:
    with newton_schulz("fp32"):
        engine = _engine(recipe_name, stage)
        engine.load_checkpoint(directory, tag="step2")
        _train(engine, range(2, 4))
        result = _compare(engine, recipe_name)
        engine.destroy()
    return result


def _compare(engine: zerodp.ZeroEngine, recipe_name: str) -> dict[str, Any]:
    """Weights and optimizer state against the uninterrupted run: the same torch
    optimizer(s), one process, the global batches."""
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    plain = LayoutNet()
    stepper = recipe.for_reference(list(plain.parameters()))
    for step in range(4):
        for param in plain.parameters():
            param.grad = None
        layout_loss(plain(global_batch(step))).backward()
        stepper.step()
    weights, state, compared, missing = 0.0, 0.0, 0, []
    for param, plain_param in zip(engine.module.parameters(), plain.parameters(), strict=True):
        full = zerodp.utils.safe_get_full_fp32_param(param)
        weights = max(weights, (full - plain_param.detach()).abs().max().item())
        for key, expected in stepper.state_of(plain_param).items():
            actual = zerodp.utils.safe_get_full_optimizer_state(param, key)
            if actual is None:  # every rank sees the same (a collective answer)
                missing.append(key)
                continue
            actual = actual.reshape(expected.shape).to(expected.dtype)
            state = max(state, (actual - expected).abs().max().item())
            compared += 1
    steps = engine.global_steps
    return {
        "weights": weights,
        "state": state,
        "compared": compared,
        "steps": steps,
        "missing": missing,
    }


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_resume_at_another_world_size_equals_one_process(
    pools: Any, tmp_path: Path, scenario: str
) -> None:
    (save_ws, save_stage), (load_ws, load_stage) = SCENARIOS[scenario]
    for recipe_name in RECIPE_NAMES:
        directory = str(tmp_path / recipe_name)
        in_place = pools(save_ws).run(save_after_two_steps, recipe_name, save_stage, directory)
        results = pools(load_ws).run(resume_and_compare, recipe_name, load_stage, directory)
        label = f"{recipe_name}: saved at world size {save_ws}, loaded at {load_ws}"
        for result in results + in_place:
            assert not result["missing"], f"{label}: no state {result}"
            assert result["steps"] == 4, (label, result)
            assert result["compared"] >= 15, (label, result)
            assert result["weights"] <= TOLERANCE, (label, result)
            assert result["state"] <= TOLERANCE, (label, result)
