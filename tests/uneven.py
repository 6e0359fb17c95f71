"""Ranks that do different things at the same point: the pairings of uneven inputs.

Shared by the pool test (tests/distributed/test_uneven_pairings.py: every pairing of two
activities that issue collectives, many per process) and by the exit scenarios
(tools/exit_scenarios.py, `uneven/<config>/<a>/<b>`: one pairing per run, uncaught, so that
each rank's exit status is seen).

Every rank of a scenario trains two steps, saves a checkpoint to load later, runs one more
forward and a backward that keeps its graph: the point where every activity below can
come next. Then the last rank does activity `b` and the others do `a`:

- forward: a forward (stage 3 gathers parameters; stages 0-2 exchange nothing in a forward,
  so there it is no activity the ranks can disagree on: `ACTIVITIES_AT`);
- backward: a second backward through the kept graph (its gradient reductions);
- step: the optimizer step;
- save, load: a checkpoint save, a load of the one saved before;
- end: the rank's script ends (exit scenarios only: a pool worker cannot end).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs
from zerodp.comm.agreement import agreement

ACTIVITIES = ("forward", "backward", "step", "save", "load", "end")
# How UnevenInputsError describes a rank doing each (after "rank N ").
DESCRIBED = {
    "forward": "is in a forward pass",
    "backward": "is in a backward pass",
    "step": "is in an optimizer step",
    "save": "is saving a checkpoint",
    "load": "is loading a checkpoint",
    "end": "ended its script",
}


@dataclass(frozen=True)
class UnevenConfig:
    stage: int
    world_size: int = 2
    shard_size: int | None = None  # mics_shard_size: shard groups of this many ranks

    def config(self, timeout_s: float = 60) -> dict[str, Any]:
        zero = {"mics_shard_size": self.shard_size} if self.shard_size else None
        config = zerodp_config(
            self.stage,
            optimizer=optimizer_config("AdamW", lr=1e-2),
            persistence_threshold=0 if self.stage == 3 else None,
            zero=zero,
        )
        config["comms_timeout_s"] = timeout_s
        return config


CONFIGS = {
    "stage0": UnevenConfig(0),
    "stage1": UnevenConfig(1),
    "stage2": UnevenConfig(2),
    "stage3": UnevenConfig(3),
    "shards1": UnevenConfig(1, world_size=4, shard_size=2),
    "shards3": UnevenConfig(3, world_size=4, shard_size=2),
}


def activities_at(stage: int) -> tuple[str, ...]:
    """The activities that issue collectives at `stage` (a forward only gathers at 3)."""
    return ACTIVITIES if stage == 3 else tuple(a for a in ACTIVITIES if a != "forward")


def pairings(stage: int, with_end: bool = True) -> list[tuple[str, str]]:
    """Every unordered pair of different activities at `stage`."""
    kinds = [a for a in activities_at(stage) if with_end or a != "end"]
    return list(itertools.combinations(kinds, 2))


def activity_of(rank: int, world_size: int, pairing: tuple[str, str]) -> str:
    """The last rank does the pairing's second activity, every other rank its first."""
    return pairing[1] if rank == world_size - 1 else pairing[0]


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def prepare(engine: zerodp.ZeroEngine, rank: int, base: Path) -> torch.Tensor:
    """Train two steps, save `base`, run a forward and a backward that keeps its graph;
    return the loss whose graph is kept (every activity can come next)."""
    for step in range(2):
        engine.backward(_loss(engine(tiny_inputs(rank, step))))
        engine.step()
    engine.save_checkpoint(base, tag="base")
    loss = _loss(engine(tiny_inputs(rank, 2)))
    engine.backward(loss, retain_graph=True)
    return loss


def perform(
    engine: zerodp.ZeroEngine, activity: str, rank: int, loss: torch.Tensor, dirs: Path
) -> None:
    """Run `activity` (not "end": that is the caller's return)."""
    if activity == "forward":
        engine(tiny_inputs(rank, 3))
    elif activity == "backward":
        engine.backward(loss)
    elif activity == "step":
        engine.step()
    elif activity == "save":
        engine.save_checkpoint(dirs / "later")
    elif activity == "load":
        engine.load_checkpoint(dirs / "base", tag="base")
    else:
        raise ValueError(f"unknown activity {activity!r}")


@dataclass(frozen=True)
class Outcome:
    """What one rank saw in one pairing."""

    pairing: tuple[str, str]
    error: str  # "Type: message", or "" when nothing was raised
    seconds: float  # from the start of the activity to the error


def run_pairing(
    config_name: str, pairing: tuple[str, str], rank: int, dirs: Path, catch: bool = True
) -> Outcome:
    """One pairing on this rank: prepare, then the rank's activity ("end": return at once).

    With `catch`, the error is returned, and the engine destroyed and the disagreement
    forgotten, so that the process can run the next pairing; else the error propagates.
    """
    setup = CONFIGS[config_name]
    torch.manual_seed(0)
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=setup.config())
    loss = prepare(engine, rank, dirs)
    activity = activity_of(rank, setup.world_size, pairing)
    start = time.monotonic()
    error = ""
    try:
        if activity != "end":
            perform(engine, activity, rank, loss, dirs)
    except zerodp.UnevenInputsError as caught:
        if not catch:
            raise
        error = f"{type(caught).__name__}: {caught}"
    finally:
        print(f"ELAPSED {time.monotonic() - start:.2f} AT {time.time():.3f}", flush=True)
        if catch:
            agreement().reset()
            engine.destroy()
    return Outcome(pairing, error, time.monotonic() - start)
