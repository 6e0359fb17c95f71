"""One rank of a failing run; `tools/exit_stress.py` starts the ranks and reads their exit statuses.

Each scenario is how a real run ends when something goes wrong, on 2 ranks (gloo on the CPU):

- `frozen1`, `frozen3`: rank 1 freezes after one step (alive, in no collective) at stage 1 or 3;
  rank 0's next collective fails at `comms_timeout_s` (5 s) and the script exits 3; rank 1 wakes
  after its peer has gone, its next collective fails, and it exits 3 too.
- `mismatch`: the ranks start with different ZeRO stages; `RankMismatchError` on both (exit 1).
- `divergence`: rank 1 skips a module at stage 3; `DivergenceError` on both (exit 1).
- `checkpoint`: a save into a path that is a file (the second argument); `CheckpointError` on
  both (exit 1).

The third argument is a directory the uneven scenarios may save into.
- `user_error`: rank 1's own code raises `ValueError` after two steps (exit 1); rank 0, in its
  next step, fails with a `PeerFailedError` that names rank 1's error (exit 1).
- `uneven_save`: stage 3, rank 1 has one batch fewer and goes on to save a checkpoint while
  rank 0 runs the forward of its last step (gloo used to abort rank 1 there: SIGABRT); both
  raise `UnevenInputsError` naming each rank's place and step counts at once
  (`comms_timeout_s` is 300), and both processes end at once (exit 1).
- `uneven_end`: stage 3, rank 1 has one batch fewer and its script ends (exit 0); rank 0
  raises `UnevenInputsError` naming that (exit 1).
- `uneven_caught`, `uneven_end_caught`: as `uneven_save` at stage 2 and `uneven_end`, but the
  script catches `UnevenInputsError`, prints it and ends normally: exit 0 on every rank, at
  once, not after `comms_timeout_s` (300 s).
- `gathered_caught`, `join_caught`: rank 0 enters a `GatheredParameters` block (stage 3) or
  `engine.join()` (stage 2) while rank 1 trains on; both are activities the ranks agree on,
  so both raise `UnevenInputsError` at once, catch it and end normally: exit 0, at once (they
  used to wait out `comms_timeout_s` at exit: the collective was abandoned).
- `dead_peer`: rank 1 is killed (SIGKILL, status -9) while rank 0 waits for it in a
  collective at stage 3; rank 0's wait fails as soon as the peer's connections close (the
  timeout is 300 s) and it exits 3.
- `uneven/<config>/<a>/<b>`: one pairing of `tests/uneven.py` (the last rank does `b`, the
  others `a`: forward, backward, step, save, load or end), uncaught: exit 1 on a rank that
  raises `UnevenInputsError`, 0 on a rank whose script ended. `UNEVEN` lists every pairing
  (2 ranks at stages 0-3, 4 in shard groups).
- `oom_forward`: rank 1 runs out of memory inside its third forward at stage 3 (exit 1); rank 0
  fails with a `PeerFailedError` naming rank 1's `OutOfMemoryError`, not a divergence (exit 1).

Every status is Python's own for the error (1 for an uncaught exception) or the script's; the
statuses these runs must never end with are 134 (SIGABRT) and -6.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyNet, tiny_inputs
from tests.uneven import CONFIGS, activity_of, pairings, run_pairing

EXPECTED: dict[str, tuple[int, int]] = {
    "frozen1": (3, 3),
    "frozen3": (3, 3),
    "mismatch": (1, 1),
    "divergence": (1, 1),
    "checkpoint": (1, 1),
    "user_error": (1, 1),
    "oom_forward": (1, 1),
    "uneven_save": (1, 1),
    "uneven_end": (1, 0),
    "uneven_caught": (0, 0),
    "uneven_end_caught": (0, 0),
    "gathered_caught": (0, 0),
    "join_caught": (0, 0),
    "dead_peer": (3, -9),
}


def _uneven_pairings() -> dict[str, tuple[int, ...]]:
    scenarios: dict[str, tuple[int, ...]] = {}
    for name, setup in CONFIGS.items():
        for pairing in pairings(setup.stage):
            statuses = tuple(
                0 if activity_of(rank, setup.world_size, pairing) == "end" else 1
                for rank in range(setup.world_size)
            )
            scenarios[f"uneven/{name}/{pairing[0]}/{pairing[1]}"] = statuses
    return scenarios


UNEVEN = _uneven_pairings()  # every pairing, each rank's expected status


class SkippingNet(nn.Module):
    """Rank 1 skips `extra`: at stage 3 its gathers differ from rank 0's."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.body = nn.Linear(7, 7)
        self.extra = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(x)
        return x if self.rank == 1 else self.extra(x)


def _out_of_memory(module: nn.Module, args: object) -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")


def _config(stage: int, timeout: float = 5) -> dict:
    config = zerodp_config(
        stage, optimizer=optimizer_config("AdamW", lr=1e-2), persistence_threshold=0
    )
    config["comms_timeout_s"] = timeout
    return config


def _train(engine: zerodp.ZeroEngine, rank: int, steps: range) -> None:
    for step in steps:
        engine.backward(engine(tiny_inputs(rank, step)).square().mean())
        engine.step()


def frozen(stage: int, rank: int) -> None:
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=_config(stage))
    _train(engine, rank, range(1))
    if rank == 1:
        time.sleep(15)  # frozen past rank 0's timeout; rank 0 has failed and gone by now
    try:
        _train(engine, rank, range(1, 3))
    except zerodp.CollectiveError as error:
        print(f"rank {rank}: {error}", flush=True)
        sys.exit(3)


def uneven(scenario: str, rank: int) -> None:
    """Rank 1 has one batch fewer; it saves (`uneven_save`, `uneven_caught`) or its script
    ends; with `_caught` the script catches the error and ends normally."""
    stage = 2 if scenario == "uneven_caught" else 3
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=_config(stage, timeout=300))
    start = time.monotonic()
    try:
        _train(engine, rank, range(4 - rank))  # rank 1 has one batch fewer
        if scenario in ("uneven_save", "uneven_caught"):
            engine.save_checkpoint(sys.argv[3])
    except zerodp.UnevenInputsError as error:
        if not scenario.endswith("_caught"):
            raise
        print(f"rank {rank} caught {type(error).__name__}: {error}", flush=True)
    finally:
        print(f"ELAPSED {time.monotonic() - start:.1f} AT {time.time():.3f}", flush=True)


def dead_peer(rank: int) -> None:
    """Rank 1 is killed (SIGKILL: a lost node) while rank 0 waits for it in a collective;
    rank 0's wait ends as soon as the connection closes, long before `comms_timeout_s`."""
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=_config(3, timeout=300))
    _train(engine, rank, range(2))
    if rank == 1:
        time.sleep(1.0)  # rank 0 is waiting in its next step's first collective by then
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        _train(engine, rank, range(2, 3))
    except zerodp.CollectiveError as error:
        print(f"rank {rank} {type(error).__name__}: {error}", flush=True)
        print(f"ELAPSED {time.monotonic() - start:.1f} AT {time.time():.3f}", flush=True)
        sys.exit(3)


def outside_activities(scenario: str, rank: int) -> None:
    """Collectives of something only rank 0 does (a `GatheredParameters` block at stage 3,
    `engine.join()` at stage 2) while rank 1 trains on: caught by both, which end normally."""
    stage = 3 if scenario == "gathered_caught" else 2
    model = TinyNet()
    engine, _, _, _ = zerodp.initialize(model=model, config=_config(stage, timeout=300))
    _train(engine, rank, range(2))
    start = time.monotonic()
    try:
        if rank == 1:
            _train(engine, rank, range(2, 3))
        elif scenario == "gathered_caught":
            with zerodp.zero.GatheredParameters(list(model.parameters())):
                print(f"rank {rank} read {sum(float(p.sum()) for p in model.parameters()):.3f}")
        else:
            with engine.join():
                _train(engine, rank, range(2, 3))
    except zerodp.UnevenInputsError as error:
        print(f"rank {rank} caught {type(error).__name__}: {error}", flush=True)
    finally:
        print(f"ELAPSED {time.monotonic() - start:.1f} AT {time.time():.3f}", flush=True)


def main() -> None:
    scenario = sys.argv[1]
    torch.manual_seed(0)
    rank = int(os.environ["RANK"])
    if scenario in ("frozen1", "frozen3"):
        frozen(int(scenario[-1]), rank)
    elif scenario == "mismatch":
        zerodp.initialize(model=TinyNet(), config=_config(3 if rank == 0 else 2))
    elif scenario == "divergence":
        engine, _, _, _ = zerodp.initialize(model=SkippingNet(rank), config=_config(3))
        engine(torch.randn(4, 7)).sum()
    elif scenario == "checkpoint":
        engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=_config(2))
        _train(engine, rank, range(1))
        engine.save_checkpoint(sys.argv[2])  # a file, not a directory
    elif scenario == "user_error":
        engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=_config(3))
        _train(engine, rank, range(2))
        if rank == 1:
            raise ValueError("the user's data loader found a corrupt record")
        _train(engine, rank, range(2, 4))
    elif scenario in ("uneven_save", "uneven_end", "uneven_caught", "uneven_end_caught"):
        uneven(scenario, rank)
    elif scenario == "dead_peer":
        dead_peer(rank)
    elif scenario in ("gathered_caught", "join_caught"):
        outside_activities(scenario, rank)
    elif scenario.startswith("uneven/"):
        _, config_name, first, second = scenario.split("/")
        # One directory per run (ranks of a run share its port), for the checkpoints.
        dirs = Path(sys.argv[3]) / f"{config_name}-{first}-{second}-{os.environ['MASTER_PORT']}"
        run_pairing(config_name, (first, second), rank, dirs, catch=False)
    elif scenario == "oom_forward":
        model = TinyNet()
        engine, _, _, _ = zerodp.initialize(model=model, config=_config(3))
        _train(engine, rank, range(2))
        if rank == 1:
            model.norm.register_forward_pre_hook(_out_of_memory)
        _train(engine, rank, range(2, 4))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}; one of {sorted(EXPECTED)} or UNEVEN")


if __name__ == "__main__":
    main()
