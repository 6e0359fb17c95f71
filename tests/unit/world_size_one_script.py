"""Run by test_world_size_one: a plain `python script.py`, no torchrun variables at all."""

from __future__ import annotations

import copy
import os
import sys

import torch

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs


def main() -> None:
    assert "WORLD_SIZE" not in os.environ
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = TinyNet()
        reference = copy.deepcopy(model)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
        config = zerodp_config(  # the global batch only: the micro batch follows from it
            stage,
            micro_batch=None,
            optimizer=optimizer_config("AdamW", lr=1e-2, weight_decay=0.0),
            persistence_threshold=0,
            train_batch_size=4,
        )
        engine, _, _, _ = zerodp.initialize(model=model, config=config)
        assert engine.world_size == 1
        for step in range(3):
            x = tiny_inputs(0, step)
            engine.backward(engine(x).square().mean())
            engine.step()
            reference(x).square().mean().backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        for param, ref_param in zip(model.parameters(), reference.parameters(), strict=True):
            full = zerodp.utils.safe_get_full_fp32_param(param)
            torch.testing.assert_close(full, ref_param.detach(), rtol=1e-6, atol=1e-7)
        engine.destroy()
        print(f"stage {stage}: ok")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
