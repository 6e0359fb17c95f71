"""A DeepSpeed-shaped training script that is restartable as it is: `load_checkpoint` at
the start (nothing there the first time), `save_checkpoint` after every step, the loader
from `initialize`, `train_batch_size` fixed. Used by test_resize (in a worker pool, at
world sizes 1 and 2) and by test_elastic (as torchrun's script, restarted by its agents).

    python -m torch.distributed.run ... tests/distributed/resumable_training.py \
        --ckpt DIR --until 10 --out weights.pt [--optimizer sgd] [--step-sleep 0.3]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script by torchrun: the repository on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.utils.data import TensorDataset

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet

NUM_SAMPLES = 18  # not a multiple of the global batch: the epochs end padded
GLOBAL_BATCH = 4
SEED = 5
OPTIMIZERS = {
    "adamw": (optimizer_config("AdamW", lr=1e-2, weight_decay=0.01), torch.optim.AdamW),
    "sgd": (optimizer_config("SGD", lr=0.1, momentum=0.9), torch.optim.SGD),
}


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(99)
    inputs = torch.randn(NUM_SAMPLES, 7, generator=generator)
    return TensorDataset(inputs, torch.randn(NUM_SAMPLES, 5, generator=generator))


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).square().mean()


class _Said(logging.Handler):
    """The warnings zerodp logs (what a load of an empty directory says)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train_resumable(
    ckpt_dir: str,
    until: int,
    optimizer: str = "adamw",
    stage: int = 2,
    step_sleep: float = 0.0,
    save_every: int = 1,
) -> dict[str, Any]:
    """Resume from `ckpt_dir` if it holds a checkpoint, train to step `until` saving after
    every `save_every` steps; the full fp32 weights, and what the load said and found."""
    torch.manual_seed(0)
    model = TinyNet()
    config = zerodp_config(
        stage,
        micro_batch=1,
        train_batch_size=GLOBAL_BATCH,
        optimizer=OPTIMIZERS[optimizer][0],
        seed=SEED,
    )
    engine, _, loader, _ = zerodp.initialize(model=model, config=config, training_data=dataset())
    said = _Said()
    logging.getLogger("zerodp").addHandler(said)
    try:
        path, client_state = engine.load_checkpoint(ckpt_dir)
    finally:
        logging.getLogger("zerodp").removeHandler(said)
    start = engine.global_steps
    while engine.global_steps < until:
        for x, y in loader:
            steps = engine.global_steps
            engine.backward(loss_of(engine, x, y))
            engine.step()
            if engine.global_steps > steps and engine.global_steps % save_every == 0:
                engine.save_checkpoint(ckpt_dir)
                time.sleep(step_sleep)
            if engine.global_steps >= until:
                break
    weights = [zerodp.utils.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    result = {
        "weights": weights,
        "loaded": path,
        "client_state": client_state,
        "load_log": said.lines,
        "start": start,
        "world_size": engine.world_size,
        "accumulation": engine.gradient_accumulation_steps(),
    }
    engine.destroy()
    return result


def reference_weights(until: int, optimizer: str = "adamw") -> list[torch.Tensor]:
    """The uninterrupted run in one process with the torch optimizer: step k averages the
    losses of global positions k*B .. k*B+B-1 of the epochs' order, written out here: each
    epoch a permutation seeded with seed + epoch, completed to a whole number of global
    batches from its own start."""
    torch.manual_seed(0)
    model = TinyNet()
    params = dict(OPTIMIZERS[optimizer][0]["params"])
    torch_optimizer = OPTIMIZERS[optimizer][1](model.parameters(), **params)
    data = dataset()
    steps_per_epoch = -(-NUM_SAMPLES // GLOBAL_BATCH)
    order: list[int] = []
    for epoch in range(-(-until // steps_per_epoch)):
        perm = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        padded = perm.tolist() * 2
        order += padded[: steps_per_epoch * GLOBAL_BATCH]
    for step in range(until):
        batch = order[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        x, y = data[batch]
        loss_of(model, x, y).backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--until", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    result = train_resumable(args.ckpt, args.until, args.optimizer, args.stage, args.step_sleep)
    if os.environ.get("RANK", "0") == "0":
        torch.save(result, args.out)


if __name__ == "__main__":
    main()
