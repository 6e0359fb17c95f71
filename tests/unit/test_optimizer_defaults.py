"""A config Adam/AdamW gets torch's fused kernel unless the config chooses (docs/offload.md)."""

from __future__ import annotations

import torch

from zerodp.config import load_config
from zerodp.optim.factory import optimizer_sources, steps_fused
from zerodp.optim.param_groups import resolve_param_groups


def _kwargs(params: dict, device: str = "cpu") -> dict:
    config = load_config(
        {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": params}}, world_size=1
    )
    specs = resolve_param_groups(torch.nn.Linear(2, 2), None, None)
    prefer = steps_fused(torch.device(device))
    _, (source,), _ = optimizer_sources(None, config.optimizer, specs, {}, prefer_fused=prefer)
    return source.kwargs


def test_fused_by_default_where_torch_has_the_kernel() -> None:
    assert _kwargs({"lr": 0.1})["fused"] is True
    assert steps_fused(torch.device("cuda")) and not steps_fused(torch.device("meta"))
    assert "fused" not in _kwargs({"lr": 0.1}, device="meta")
    assert _kwargs({"lr": 0.1, "fused": False})["fused"] is False
    assert "fused" not in _kwargs({"lr": 0.1, "foreach": True})
