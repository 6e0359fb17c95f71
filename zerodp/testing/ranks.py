"""Start the ranks of a script as plain processes and read each one's exit status.

torchrun (and `zerodp run`) stops the other ranks once one fails, so the status it reports
for them is its own SIGTERM, not theirs. A test of how a run *ends* needs every rank's own
status: these processes are started with torchrun's environment and waited for one by one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from zerodp.testing.dist import free_port, worker_env


@dataclass(frozen=True)
class RankExit:
    """How one rank ended: its exit status (negative: killed by that signal) and output."""

    rank: int
    status: int | None  # None: still running at the deadline (then killed)
    output: str


def run_ranks(
    argv: Sequence[str],
    world_size: int = 2,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[RankExit]:
    """Run `python argv...` as `world_size` ranks on 127.0.0.1; every rank's exit."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {**os.environ, **worker_env(rank, world_size, port), **(env or {})}
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout_s
    exits = []
    for rank, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            status: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            status = None
        exits.append(RankExit(rank, status, output))
    return exits
