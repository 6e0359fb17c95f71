"""Start one multi-rank job of bench/_scaling_worker.py in fresh processes and collect it.

The ranks are started directly with torchrun's environment variables (RANK,
WORLD_SIZE, MASTER_ADDR, ...) rather than through torchrun's agent: on two
shared CPU cores the agent's own interpreter start costs seconds per attempt,
and a memory-budget search makes dozens of attempts. Like torchrun, the first
rank to fail stops its peers, and a job that overruns its time limit is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "_scaling_worker.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def deepspeed_python(candidate: str | None) -> str | None:
    """`candidate` when it is an interpreter that can import deepspeed; otherwise None."""
    if not candidate or not Path(candidate).exists():
        return None
    probe = subprocess.run(
        [candidate, "-c", "import deepspeed"], capture_output=True, text=True, check=False
    )
    return candidate if probe.returncode == 0 else None


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def launch(
    task: dict[str, Any],
    world_size: int,
    python: str,
    timeout_s: float,
    extra_env: dict[str, str] | None = None,
    worker: Path = WORKER,
) -> tuple[list[int | None], Path]:
    """Run `task` on `world_size` ranks of `worker` (bench/_scaling_worker.py unless given);
    (each rank's exit code, None if stopped; output path)."""
    workdir = Path(tempfile.mkdtemp(prefix="zerodp-scaling-"))
    task_path, out_path = workdir / "task.json", workdir / "out.json"
    task_path.write_text(json.dumps(task))
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        **(extra_env or {}),
    }
    procs = []
    for rank in range(world_size):
        rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                [python, str(worker), str(task_path), str(out_path)],
                env=rank_env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL if rank else None,
                stderr=None if rank == 0 else subprocess.DEVNULL,
                start_new_session=True,  # its own process group, so a stop reaches its children
            )
        )
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = [None] * world_size
    try:
        while any(c is None for c in codes):
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                break  # a rank failed (its peers may wait on it forever) or time is up
            time.sleep(0.2)
    finally:
        _stop(procs)
    return codes, out_path


def rank_results(out_path: Path, world_size: int) -> list[dict[str, Any] | None]:
    """The per-rank JSON a fit task writes; None for a rank that died before writing it."""
    results: list[dict[str, Any] | None] = []
    for rank in range(world_size):
        path = Path(f"{out_path}.rank{rank}")
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results
