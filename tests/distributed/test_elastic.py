"""Losing a node: torchrun's elastic agents restart the survivors at the smaller world, and
the run goes on as the same run.

Two torchrun agents on this machine (`--nnodes 1:2`, c10d rendezvous, `--max-restarts 3`),
one process each, run the restartable script (`resumable_training.py`: load at the start,
save every step, train_batch_size 4). Once the run has saved step 3 at world 2, the second
agent and its worker are killed (SIGKILL: a node lost). The survivor's worker ends at its
next collective (the peer's connection closed), its agent restarts it at world 1, the
script resumes from the last checkpoint with 4 micro-batches per step instead of 2, and
its weights at step 10 equal the uninterrupted run's, computed here in one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.resumable_training import reference_weights
from zerodp.launch.node_agent import descendants
from zerodp.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("resumable_training.py")


def _agent(port: int, ckpt: Path, out: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2"),
        *("--nproc-per-node", "1", "--max-restarts", "3", "--monitor-interval", "0.2"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
        *("--rdzv-id", "elastic-test", "--rdzv-conf", "last_call_timeout=5"),
        *(str(SCRIPT), "--ckpt", str(ckpt), "--until", "10", "--out", str(out)),
        *("--optimizer", "sgd", "--step-sleep", "0.15"),
    ]
    return subprocess.Popen(
        command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _store_host(port: int, agents: list[subprocess.Popen]) -> int:
    """Which agent hosts the rendezvous store: the one listening on its port (/proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    for index, agent in enumerate(agents):
        for fd in Path(f"/proc/{agent.pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in {f"socket:[{inode}]" for inode in inodes}:
                    return index
    raise AssertionError(f"no agent listens on port {port}")


def _logs(folder: Path) -> str:
    return "\n".join(
        f"--- {log.name}\n{log.read_text()[-3000:]}" for log in sorted(folder.glob("agent*.log"))
    )


def _saved(ckpt: Path) -> tuple[int, int]:
    """(step, world size) of the newest checkpoint; (0, 0) before the first."""
    try:
        tag = (ckpt / "latest").read_text().strip()
        state = json.loads((ckpt / tag / "zerodp_state.json").read_text())
    except (OSError, ValueError):
        return 0, 0
    return state["counters"]["global_steps"], state["world_size"]


def _kill_tree(process: subprocess.Popen) -> None:
    for pid in [process.pid, *descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(400)
def test_a_run_that_loses_a_node_finishes_as_the_uninterrupted_run(tmp_path: Path) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ZERODP_DEVICE": "cpu"})
    port, ckpt, out = free_port(), tmp_path / "ckpt", tmp_path / "weights.pt"
    # Both agents start together, so that the first rendezvous round has both; the one that
    # hosts the rendezvous store must survive (the store dies with it): the other is lost.
    agents = [_agent(port, ckpt, out, env, tmp_path / f"agent{i}.log") for i in range(2)]
    try:
        deadline = time.monotonic() + 240
        while _saved(ckpt)[0] < 3:
            assert time.monotonic() < deadline, _logs(tmp_path)
            assert all(agent.poll() is None for agent in agents), _logs(tmp_path)
            time.sleep(0.05)
        step, world = _saved(ckpt)
        assert world == 2 and step < 10, (step, world)  # lost mid-run, at world 2
        host = _store_host(port, agents)
        survivor, lost = agents[host], agents[1 - host]
        _kill_tree(lost)
        status = survivor.wait(timeout=300)
        assert status == 0, _logs(tmp_path)
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_tree(agent)
    result = torch.load(out)
    assert result["world_size"] == 1 and result["accumulation"] == 4
    assert result["start"] >= step  # resumed from the last checkpoint, not from scratch
    want = reference_weights(10, "sgd")
    difference = max(
        (a - b).abs().max().item() for a, b in zip(result["weights"], want, strict=True)
    )
    assert difference < 1e-6, difference
