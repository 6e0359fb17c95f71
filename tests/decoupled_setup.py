"""The run the decoupled-writer tests save and resume: a small model with dropout (so the
random generators matter), a data loader, an LR schedule, and accumulation 2 (so a save
between micro-steps holds a window's kept gradients).

Shared by tests/distributed/test_decoupled_save.py and the script it starts as fresh
ranks (tests/distributed/decoupled_save_script.py), so both train the same run.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import DropoutNet

GAS = 2
OPTIMIZER_STATE = {"AdamW": ("exp_avg", "exp_avg_sq"), "SGD": ("momentum_buffer",)}


def config(stage: int, optimizer: str, decoupled: bool) -> dict[str, Any]:
    params: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.01}
    if optimizer == "SGD":
        params = {"lr": 1e-2, "momentum": 0.9}
    return zerodp_config(
        stage,
        gas=GAS,
        optimizer=optimizer_config(optimizer, **params),
        clipping=1.0,
        persistence_threshold=12,
        zero={"reduce_bucket_size": 64},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 8}},
        seed=7,
        checkpoint={"writer": {"decoupled": decoupled}},
    )


def build(stage: int, optimizer: str = "AdamW", decoupled: bool = True, seed: int = 0) -> Any:
    """(model, engine, loader)."""
    torch.manual_seed(seed)
    model = DropoutNet()
    data = TensorDataset(torch.randn(200, 7, generator=torch.Generator().manual_seed(99)))
    engine, _, loader, _ = zerodp.initialize(
        model=model, config=config(stage, optimizer, decoupled), training_data=data
    )
    return model, engine, loader


def micro_steps(engine: Any, loader: Any, count: int) -> None:
    """`count` micro-steps (backward + step each) from where the loader is."""
    done = 0
    while done < count:
        for (x,) in loader:
            engine.backward(engine(x).float().square().mean())
            engine.step()
            done += 1
            if done == count:
                return


def state(model: nn.Module, engine: Any, optimizer: str = "AdamW") -> dict[str, Any]:
    """Everything a resumed run must reproduce, bit for bit: weights, kept gradients,
    optimizer state, lr, counters and the random generators."""
    params = list(model.parameters())
    out: dict[str, Any] = {
        "params": [zerodp.utils.safe_get_full_fp32_param(p) for p in params],
        "grads": [zerodp.utils.safe_get_full_grad(p) for p in params],
        "lr": engine.get_lr(),
        "counters": (engine.global_steps, engine.micro_steps, engine.global_samples),
        "rng": torch.get_rng_state(),
        "python_random": random.getstate(),
    }
    for key in OPTIMIZER_STATE[optimizer]:
        out[key] = [zerodp.utils.safe_get_full_optimizer_state(p, key) for p in params]
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    for key, values in a.items():
        if key in ("lr", "counters", "python_random"):
            assert values == b[key], f"{what}: {key} differs"
        elif key == "rng":
            assert torch.equal(values, b[key]), f"{what}: rng differs"
        else:
            for index, (x, y) in enumerate(zip(values, b[key], strict=True)):
                if x is None or y is None:
                    assert x is None and y is None, (what, key, index)
                    continue
                assert torch.equal(x, y), f"{what}: {key}[{index}] differs"
