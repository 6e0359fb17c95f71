"""Stages 0-3 against ideal data parallelism: every gradient after every backward, every weight
after every step, at world sizes 2 and 3 (170 parameters: padded shards at 3).

The reference is computed in the test (`ReferenceDP`: a plain model copy per rank, each
backward's gradients averaged with an explicit all_reduce), driven in lockstep with zerodp by
`tests.lockstep.Lockstep`. DDP runs alongside as a second witness; every case here is one
where DDP is correct.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.configs import zerodp_config
from tests.lockstep import Lockstep
from tests.models import TinyNet, tiny_inputs


@dataclass(frozen=True)
class Scenario:
    steps: int
    gas: int
    optimizer: dict[str, Any]
    reference_optimizer: str
    reference_kwargs: dict[str, Any]
    clip: float = 0.0
    two_groups: bool = False


SCENARIOS = {
    "single_loss": Scenario(
        steps=1,
        gas=1,
        optimizer={"type": "Adam", "params": {"lr": 1e-2}},
        reference_optimizer="AdamW",  # DeepSpeed's "Adam" decouples weight decay by default
        reference_kwargs={"lr": 1e-2, "weight_decay": 0.0},
    ),
    "accumulation_4": Scenario(
        steps=2,
        gas=4,
        optimizer={"type": "Adam", "params": {"lr": 1e-2}},
        reference_optimizer="AdamW",
        reference_kwargs={"lr": 1e-2, "weight_decay": 0.0},
    ),
    "adam_10_steps": Scenario(
        steps=10,
        gas=1,
        optimizer={
            "type": "Adam",
            "params": {"lr": 1e-2, "weight_decay": 0.01, "adam_w_mode": False},
        },
        reference_optimizer="Adam",
        reference_kwargs={"lr": 1e-2, "weight_decay": 0.01},
    ),
    "adamw_10_steps_clipped": Scenario(
        steps=10,
        gas=1,
        optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
        reference_optimizer="AdamW",
        reference_kwargs={"lr": 1e-2, "weight_decay": 0.05},
        clip=0.05,
    ),
    "two_param_groups": Scenario(
        steps=5,
        gas=1,
        optimizer={"type": "SGD", "params": {"lr": 5e-2, "momentum": 0.9}},
        reference_optimizer="SGD",
        reference_kwargs={"lr": 5e-2, "momentum": 0.9},
        two_groups=True,
    ),
}


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Matrices decay at one rate with the default lr; vectors do not decay and use their own lr."""
    matrices = [p for p in model.parameters() if p.ndim > 1]
    vectors = [p for p in model.parameters() if p.ndim <= 1]
    return [
        {"params": matrices, "weight_decay": 0.1},
        {"params": vectors, "weight_decay": 0.0, "lr": 2e-2},
    ]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def run_scenario(stage: int, name: str, bucket: int) -> None:
    scenario = SCENARIOS[name]
    torch.manual_seed(0)
    model = TinyNet()
    ddp_model = DistributedDataParallel(copy.deepcopy(model))
    config = zerodp_config(
        stage,
        gas=scenario.gas,
        optimizer=scenario.optimizer,
        clipping=scenario.clip,
        persistence_threshold=12,
        zero={"reduce_bucket_size": bucket},
    )
    optimizer_class = getattr(torch.optim, scenario.reference_optimizer)

    def make_optimizer(params: Any) -> torch.optim.Optimizer:
        return optimizer_class(params, **scenario.reference_kwargs)

    # Gradients compared after every micro-batch, weights after every step (in Lockstep).
    run = Lockstep(
        model,
        config,
        make_optimizer,
        param_groups=_param_groups if scenario.two_groups else None,
        label=f"stage {stage}, {name}",
    )
    ddp_params = _param_groups(ddp_model.module) if scenario.two_groups else ddp_model.parameters()
    ddp_optimizer = make_optimizer(ddp_params)

    for step in range(scenario.steps):
        for micro in range(scenario.gas):
            x = tiny_inputs(run.rank, step * scenario.gas + micro)
            out, ref_out = run.forward(x)
            run.backward((out.square().mean(), ref_out.square().mean()))
            (_loss(ddp_model, x) / scenario.gas).backward()
            where = f"stage {stage}, {name}, step {step}, micro-batch {micro}"
            if stage == 0 and micro == scenario.gas - 1:
                # Stage 0 shows the averaged gradient as .grad once the boundary reduced it
                # (between boundaries .grad holds this rank's local sum, as under DDP's no_sync).
                for param, ddp_param in zip(
                    model.parameters(), ddp_model.parameters(), strict=True
                ):
                    torch.testing.assert_close(param.grad, ddp_param.grad, msg=f"{where}: DDP")
            boundary = run.step()
        assert boundary, f"stage {stage}, {name}: step {step} ended without a boundary"
        if scenario.clip:
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), scenario.clip)
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()
        for ref_param, ddp_param in zip(
            run.ref_model.parameters(), ddp_model.parameters(), strict=True
        ):
            torch.testing.assert_close(ref_param, ddp_param, msg="the reference disagrees with DDP")
    run.close()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parity(pools, stage: int, name: str, world_size: int) -> None:
    # A small bucket splits the 170 parameters into several padded flat groups.
    bucket = 64 if name != "single_loss" else 500_000_000
    pools(world_size).run(run_scenario, stage, name, bucket)
