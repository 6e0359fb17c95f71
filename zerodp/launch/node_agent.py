"""What runs on each host of a `zerodp run --hostfile` launch: torchrun, kept stoppable.

    python .../zerodp/launch/node_agent.py --run-id ID --node-rank R --nnodes N \
        --node-slots 0,1/0,1 --master-addr HOST --master-port PORT [--watch-stdin] -- ARGS
    python .../zerodp/launch/node_agent.py --stop ID

It runs as a file (the same path in the same Python environment on every host, as the
interpreter's), with the standard library only, so it starts at once, without importing
zerodp; so does torchrun's process (`zerodp/launch/torchrun_status.py`, torch only).

The agent runs torchrun (`torchrun_status.py`: its exit status the failed rank's, as
`zerodp run` reports it) in a session of its own, with the node's
rank, its process count and `CUDA_VISIBLE_DEVICES` from its slots, and waits. It stops
torchrun, and every process torchrun started, when it is asked to: SIGTERM, SIGINT or
SIGHUP, end of its standard input (`--watch-stdin`: ssh closes it when the launcher
closes its side or the connection drops), or `--stop ID` run on the same host (for
pdsh, which forwards no input; it finds the agents by the pid files of the run).
torchrun gets SIGTERM and stops its workers itself; whatever is left after
`STOP_GRACE_S` (torchrun's workers run in sessions of their own) is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

FILE = str(Path(__file__).resolve())
STOP_GRACE_S = 20.0
"""How long torchrun may take to stop its workers before everything left is killed."""


def run_dir(run_id: str) -> Path:
    return Path(tempfile.gettempdir()) / "zerodp-runs" / run_id


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux's /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = entry.read_text()
        except OSError:
            continue
        fields = text.rpartition(")")[2].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class Agent:
    """torchrun in its own session, and the ways to stop it."""

    def __init__(self, command: list[str], env: dict[str, str], pid_file: Path) -> None:
        self.stop_requested = threading.Event()
        self.child = subprocess.Popen(command, env=env, start_new_session=True)
        self.pid_file = pid_file
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(str(os.getpid()))

    def request_stop(self, *_: object) -> None:
        self.stop_requested.set()

    def watch_stdin(self) -> None:
        def read_until_end() -> None:
            # os.read on the descriptor: a thread blocked in it holds no lock of the
            # interpreter's (sys.stdin's buffer would abort the interpreter's exit).
            with contextlib.suppress(OSError):
                while os.read(0, 4096):
                    pass
            self.request_stop()

        threading.Thread(target=read_until_end, daemon=True, name="zerodp stdin").start()

    def run(self) -> int:
        """Wait for torchrun, or for a stop; torchrun's exit status, or 143 when stopped."""
        try:
            while self.child.poll() is None:
                if self.stop_requested.wait(0.2):
                    self.stop()
                    return 128 + int(signal.SIGTERM)
            return int(self.child.returncode)
        finally:
            self.pid_file.unlink(missing_ok=True)

    def stop(self) -> None:
        """SIGTERM to torchrun, which stops its workers; then kill whatever is left."""
        # torchrun's workers run in sessions of their own, and are no longer below torchrun
        # once it has gone: note them while it lasts.
        seen = set(descendants(self.child.pid))
        _kill([self.child.pid], signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and self.child.poll() is None:
            seen.update(descendants(self.child.pid))
            time.sleep(0.1)
        _kill([self.child.pid, *seen], signal.SIGKILL)
        self.child.wait()


def _node_env(slots: str, node_rank: int) -> tuple[dict[str, str], int]:
    per_node = slots.split("/")
    if not 0 <= node_rank < len(per_node):
        raise SystemExit(f"node agent: node rank {node_rank} outside the {len(per_node)} nodes")
    mine = per_node[node_rank]
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = mine
    return env, len(mine.split(","))


def stop_run(run_id: str) -> int:
    """Ask every agent of `run_id` on this host to stop (SIGTERM); wait for them to go."""
    pids = []
    for file in run_dir(run_id).glob("node*.pid"):
        try:
            pids.append(int(file.read_text()))
        except (OSError, ValueError):
            continue
    _kill(pids, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.1)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python {FILE}")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--node-slots", required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", required=True)
    parser.add_argument("--watch-stdin", action="store_true")
    parser.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # run as a file: its folder must not shadow anything
    if args[:1] == ["--stop"] and len(args) == 2:
        return stop_run(args[1])
    parsed = _parser().parse_args(args)
    rest = parsed.torchrun_args[1:] if parsed.torchrun_args[:1] == ["--"] else parsed.torchrun_args
    env, nproc = _node_env(parsed.node_slots, parsed.node_rank)
    command = [
        *(sys.executable, "-u", str(Path(__file__).with_name("torchrun_status.py"))),
        *("--nnodes", str(parsed.nnodes), "--node-rank", str(parsed.node_rank)),
        *("--master-addr", parsed.master_addr, "--master-port", parsed.master_port),
        *("--nproc-per-node", str(nproc), *rest),
    ]
    agent = Agent(command, env, run_dir(parsed.run_id) / f"node{parsed.node_rank}.pid")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, agent.request_stop)
    if parsed.watch_stdin:
        agent.watch_stdin()
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
