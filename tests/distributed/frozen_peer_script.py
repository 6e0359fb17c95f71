"""Launched by test_runtime_faults (through `zerodp run -n 2`): rank 1 freezes after one step.

Rank 0 goes on to the next step, whose first collective can never complete; with
`comms_timeout_s` 10 it must end with an error naming that collective. Each rank prints
wall-clock marks (FROZEN, FAILED) for the test to measure the time in between.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs


def main() -> None:
    stage = int(sys.argv[1])
    torch.manual_seed(0)
    config = zerodp_config(
        stage, optimizer=optimizer_config("AdamW", lr=1e-2), persistence_threshold=0
    )
    config["comms_timeout_s"] = 10
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=config)
    rank = engine.global_rank
    engine.backward(engine(tiny_inputs(rank, 0)).square().mean())
    engine.step()
    if rank == 1:
        print(f"FROZEN {time.time():.3f}", flush=True)
        time.sleep(300)  # frozen: alive, but never joins another collective
    try:
        engine.backward(engine(tiny_inputs(rank, 1)).square().mean())
        engine.step()
    except zerodp.CollectiveError as error:
        print(f"FAILED {time.time():.3f}\n{error}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
