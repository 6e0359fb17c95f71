"""How a failing run ends: every rank with Python's own exit status or the script's, and the
ranks that did not fail naming the one that did.

Each scenario of tools/exit_scenarios.py runs once here, as 2 plain processes (not through
torchrun, which stops the other ranks with its own SIGTERM once one fails), all scenarios side
by side. Before [Note: ending the process] (zerodp/comm/faults/teardown.py) these ended now
and then with SIGABRT ("terminate called without an active exception", status -6) on a busy
machine; `python tools/exit_stress.py` runs each 20 times under load and tabulates the statuses.
The frozen-peer scenarios are covered by test_runtime_faults (through `zerodp run`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tools.exit_scenarios import EXPECTED
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
]


def _run(scenario: str, directory: Path) -> tuple[list[RankExit], float]:
    """Each rank's exit and the seconds from the start to the last rank's end."""
    argv = [str(SCRIPT), scenario, str(directory / "file"), str(directory / scenario)]
    start = time.monotonic()
    exits = run_ranks(argv, timeout_s=600)
    return exits, time.monotonic() - start


def _elapsed(output: str) -> float:
    marks = [line.split()[1] for line in output.splitlines() if line.startswith("ELAPSED")]
    return float(marks[0])


@pytest.mark.timeout(900)  # 7 scenarios x 2 processes side by side: slow on a loaded machine
def test_every_rank_ends_with_its_own_status_and_the_culprit_is_named(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    with ThreadPoolExecutor(len(SCENARIOS)) as pool:
        timed = dict(
            zip(SCENARIOS, pool.map(_run, SCENARIOS, [tmp_path] * len(SCENARIOS)), strict=True)
        )
    runs = {scenario: exits for scenario, (exits, _) in timed.items()}
    for scenario, exits in runs.items():
        for expected, rank_exit in zip(EXPECTED[scenario], exits, strict=True):
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

    # Uneven inputs: named on every rank that waits, with each rank's place, long before the
    # comms_timeout_s of 120 s (the stall is heard within about a second).
    for rank_exit in runs["uneven_save"]:
        assert (
            "UnevenInputsError: uneven inputs: the ranks are stuck in different places: rank 0 "
            "is training after 3 optimizer steps (3 micro-batches), waiting in reduce_scatter"
        ) in rank_exit.output, rank_exit.output
        assert "rank 1 is saving a checkpoint after 3 optimizer steps" in rank_exit.output
        assert _elapsed(rank_exit.output) < 60, rank_exit.output
    # Both processes end soon after the error, not at comms_timeout_s (300 s): the stuck
    # collectives were abandoned ([Note: ending the process]).
    assert timed["uneven_save"][1] < 200, timed["uneven_save"]
    peer, finished = runs["uneven_end"]
    assert "rank 1 ended its script after 3 optimizer steps (3 micro-batches)" in peer.output
    assert "UnevenInputsError" in peer.output and _elapsed(peer.output) < 60, peer.output
    assert "Error" not in finished.output, finished.output
