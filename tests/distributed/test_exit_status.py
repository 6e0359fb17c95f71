"""How a failing run ends: every rank with Python's own exit status or the script's, and the
ranks that did not fail naming the one that did.

Each scenario of tools/exit_scenarios.py runs once here, as 2 plain processes (not through
torchrun, which stops the other ranks with its own SIGTERM once one fails), all scenarios side
by side. Before [Note: ending the process] (zerodp/comm/faults/teardown.py) these ended now
and then with SIGABRT ("terminate called without an active exception", status -6) on a busy
machine; `python tools/exit_stress.py` runs each 20 times under load and tabulates the statuses.
The frozen-peer scenarios are covered by test_runtime_faults (through `zerodp run`).

Uneven inputs: every pairing of two activities that issue collectives raises on every rank
in test_uneven_pairings.py (in-process); here a covering set ends as processes: a save
against a stage 3 forward (which used to end rank 1 by SIGABRT), the end of a script against
a forward, an optimizer step (stage 0) and a load (4 ranks in shard groups), and a script
that catches the error (exit 0 at once), found by the agreement
or by a polled wait (the peer's script ended). `python tools/exit_stress.py --scenarios uneven`
runs every pairing with the end of a script too.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tools.exit_scenarios import EXPECTED, UNEVEN
from zerodp.testing.ranks import RankExit, run_ranks

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "exit_scenarios.py"
SCENARIOS = [
    "mismatch",
    "divergence",
    "checkpoint",
    "user_error",
    "oom_forward",
    "uneven_save",
    "uneven_end",
    "uneven_caught",
    "uneven_end_caught",
    "gathered_caught",
    "join_caught",
    "dead_peer",
    "uneven/stage0/step/end",
    "uneven/shards3/load/end",
]
_EXPECTED = {**EXPECTED, **UNEVEN}


def _run(scenario: str, directory: Path) -> tuple[list[RankExit], float]:
    """Each rank's exit and the time (`time.time()`) the last rank ended."""
    argv = [str(SCRIPT), scenario, str(directory / "file"), str(directory / scenario)]
    exits = run_ranks(argv, world_size=len(_EXPECTED[scenario]), timeout_s=600)
    return exits, time.time()


def _elapsed(output: str) -> float:
    """Seconds from the start of the uneven part of the scenario to its error."""
    marks = [line.split()[1] for line in output.splitlines() if line.startswith("ELAPSED")]
    return float(marks[0])


def _errored_at(output: str) -> float:
    """When (`time.time()`) the scenario's uneven part ended in its error."""
    marks = [line.split()[3] for line in output.splitlines() if line.startswith("ELAPSED")]
    return float(marks[0])


def _seconds_to_exit(timed: tuple[list[RankExit], float]) -> float:
    """From the first rank's error to the last rank's end: how long ending took (on a busy
    machine starting 20 processes takes minutes, so the run's length says nothing)."""
    exits, ended = timed
    return ended - min(_errored_at(rank_exit.output) for rank_exit in exits)


@pytest.mark.timeout(900)  # 11 scenarios x 2-4 processes side by side: slow on a busy machine
def test_every_rank_ends_with_its_own_status_and_the_culprit_is_named(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    with ThreadPoolExecutor(len(SCENARIOS)) as pool:
        timed = dict(
            zip(SCENARIOS, pool.map(_run, SCENARIOS, [tmp_path] * len(SCENARIOS)), strict=True)
        )
    runs = {scenario: exits for scenario, (exits, _) in timed.items()}
    for scenario, exits in runs.items():
        for expected, rank_exit in zip(_EXPECTED[scenario], exits, strict=True):
            assert rank_exit.status == expected, (scenario, rank_exit)
            assert "terminate called" not in rank_exit.output, (scenario, rank_exit)
    for scenario, error in (
        ("mismatch", "RankMismatchError: ranks disagree at start-up"),
        ("divergence", "DivergenceError: ranks took different paths"),
        ("checkpoint", "CheckpointPathError"),
    ):
        assert all(error in r.output for r in runs[scenario]), runs[scenario]
    peer, culprit = runs["user_error"]
    assert "ValueError: the user's data loader found a corrupt record" in culprit.output
    assert (
        "PeerFailedError: rank 1 failed and is ending: ValueError: the user's data loader "
        "found a corrupt record" in peer.output
    ), peer.output
    peer, culprit = runs["oom_forward"]
    assert "torch.OutOfMemoryError" in culprit.output
    assert "PeerFailedError: rank 1 failed" in peer.output, peer.output
    assert "OutOfMemoryError: CUDA out of memory" in peer.output, peer.output
    assert "DivergenceError" not in peer.output, peer.output

    # Uneven inputs: named on every rank, with each rank's place, long before the
    # comms_timeout_s of 300 s. A save against a forward is found by the agreement before
    # either collective, at once; the end of a script by the wait, within about a second.
    for rank_exit in runs["uneven_save"]:
        assert (
            "UnevenInputsError: uneven inputs: the ranks are at different places: rank 0 is in "
            "a forward pass after 3 optimizer steps (3 micro-batches), waiting in the agreement "
            "before gather"
        ) in rank_exit.output, rank_exit.output
        assert "rank 1 is saving a checkpoint after 3 optimizer steps" in rank_exit.output
        assert "terminate called" not in rank_exit.output
        assert _elapsed(rank_exit.output) < 60, rank_exit.output
    # Both processes end soon after the error, not at comms_timeout_s (300 s): nothing was
    # left running.
    assert _seconds_to_exit(timed["uneven_save"]) < 150, timed["uneven_save"]
    peer, finished = runs["uneven_end"]
    assert "rank 1 ended its script after 3 optimizer steps (3 micro-batches)" in peer.output
    assert "UnevenInputsError" in peer.output and _elapsed(peer.output) < 60, peer.output
    assert "Error" not in finished.output, finished.output
    # Caught and ended normally: exit 0 on both, soon after the error, not at
    # comms_timeout_s (300 s): found by the agreement (a save against a backward), or by the
    # polled wait of rank 0's agreement while rank 1's script ended (its collective is
    # abandoned, and ends with the peer's process).
    for rank_exit in runs["uneven_caught"]:
        assert "caught UnevenInputsError" in rank_exit.output, rank_exit.output
        assert "rank 0 is in a backward pass" in rank_exit.output
        assert "rank 1 is saving a checkpoint" in rank_exit.output
    peer, finished = runs["uneven_end_caught"]
    assert "rank 0 caught UnevenInputsError" in peer.output, peer.output
    assert "rank 1 ended its script after 3 optimizer steps" in peer.output, peer.output
    assert "Error" not in finished.output, finished.output
    for scenario in ("uneven_caught", "uneven_end_caught"):
        assert _seconds_to_exit(timed[scenario]) < 150, (scenario, timed[scenario])
    # Collectives only rank 0 makes (a GatheredParameters block, engine.join()) against rank
    # 1's training step: agreed like every activity, so found before anything is sent, and
    # both processes end soon after, not at comms_timeout_s (300 s).
    for scenario, doing in (
        ("gathered_caught", "rank 0 is gathering parameters (GatheredParameters)"),
        ("join_caught", "rank 0 is entering engine.join()"),
    ):
        for rank_exit in runs[scenario]:
            assert f"rank {rank_exit.rank} caught UnevenInputsError" in rank_exit.output
            assert doing in rank_exit.output and "rank 1 is in a " in rank_exit.output
            assert _elapsed(rank_exit.output) < 60, rank_exit.output
        assert _seconds_to_exit(timed[scenario]) < 60, (scenario, timed[scenario])
    # A peer killed while this rank waits for it: the wait ends when its connections close,
    # not at comms_timeout_s (300 s).
    survivor, _killed = runs["dead_peer"]
    assert "CollectiveError" in survivor.output and _elapsed(survivor.output) < 10, survivor
    for scenario, doing in (
        ("uneven/stage0/step/end", "is in an optimizer step after 2 optimizer steps"),
        ("uneven/shards3/load/end", "is loading a checkpoint after 2 optimizer steps"),
    ):
        *raised, finished = runs[scenario]
        assert "Error" not in finished.output, (scenario, finished.output)
        for rank_exit in raised:
            last = len(raised)
            assert f"rank {rank_exit.rank} {doing}" in rank_exit.output, (scenario, rank_exit)
            assert f"rank {last} ended its script after 2 optimizer steps" in rank_exit.output
            assert _elapsed(rank_exit.output) < 60, (scenario, rank_exit.output)
