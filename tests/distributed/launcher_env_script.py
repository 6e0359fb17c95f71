"""Run by test_launcher_envs: one process of a world started by srun or mpirun (their
variables only, no torchrun's). Trains two SGD steps and checks the weights against the
reference on both ranks' data, so the two processes must have formed one world."""

from __future__ import annotations

import copy
import os

import torch

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs


def main() -> None:
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        raise SystemExit("torchrun's variables must not be set for this script")
    torch.manual_seed(0)
    model = TinyNet()
    reference = copy.deepcopy(model)
    config = zerodp_config(
        2, micro_batch=None, train_batch_size=8, optimizer=optimizer_config("SGD", lr=0.1)
    )
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    rank, world = engine.global_rank, engine.world_size
    # The batch arithmetic saw the launcher's world before the process group was up.
    assert engine.train_micro_batch_size_per_gpu() == 8 // world, engine.config.batch_sizes
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        engine.backward(engine(tiny_inputs(rank, step)).square().mean())
        engine.step()
        for peer in range(world):  # the average of every rank's gradient, in one process
            (reference(tiny_inputs(peer, step)).square().mean() / world).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    for param, ref_param in zip(model.parameters(), reference.parameters(), strict=True):
        full = zerodp.utils.safe_get_full_fp32_param(param)
        torch.testing.assert_close(full, ref_param.detach(), rtol=1e-6, atol=1e-7)
    print(f"rank {rank} of {world}, LOCAL_RANK {os.environ['LOCAL_RANK']}: ok", flush=True)


if __name__ == "__main__":
    main()
