"""Ranks forked from a server that has already imported torch and zerodp.

    ranks = PreloadedRanks("tools.exit_scenarios")
    exits = ranks.run([script, *args], world_size=2, timeout_s=180)  # like `run_ranks`
    ranks.close()

A small failing run spends most of its CPU importing torch and zerodp (about 2.5 s of the
3.5 s a rank of `exit_scenarios.py` uses), so many runs of it are mostly imports. Here the
import is paid once: a server process imports the module, and every rank is `os.fork`ed
from it, then runs the script as `__main__` at the server's top level, with the rank's
environment and its output in a file of its own.

What a rank does from then on is what the script does as a fresh process: nothing of the
server's runs beyond the import (it makes no process group and runs no operator before it
forks), an uncaught exception prints its traceback and exits 1, `sys.exit(n)` exits n,
and the interpreter shuts down normally (atexit handlers, gloo's threads, module
teardown), which is where an abort at exit would show. The status is the one `waitpid`
gives, negative for a signal, as `subprocess` reports it.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerodp.testing.dist import free_port, worker_env
from zerodp.testing.ranks import RankExit


class PreloadedRanks:
    """A server that forks ranks after importing `module`; `run` is `run_ranks` for them."""

    def __init__(self, module: str) -> None:
        self._outputs = tempfile.TemporaryDirectory()
        self._server = subprocess.Popen(
            [sys.executable, __file__, module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._runs = 0
        # The replies are read from the pipe's descriptor, never through a buffered reader:
        # a reader could hold the next line while `select` waits on the descriptor for it.
        self._pending = b""
        if self._reply() != {"ready": True}:
            raise RuntimeError(f"the rank server did not start (importing {module})")

    def run(
        self,
        argv: Sequence[str],
        world_size: int = 2,
        timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> list[RankExit]:
        """Every rank's exit, as `zerodp.testing.ranks.run_ranks` gives it."""
        self._runs += 1
        port = free_port()
        outputs = [
            Path(self._outputs.name) / f"{self._runs}-{rank}.log" for rank in range(world_size)
        ]
        request = {
            "argv": list(argv),
            "ranks": [
                {"env": {**worker_env(rank, world_size, port), **(env or {})}, "output": str(out)}
                for rank, out in enumerate(outputs)
            ],
        }
        self._send(request)
        pids = self._reply()["pids"]
        deadline = time.monotonic() + timeout_s
        killed: set[int] = set()
        statuses: list[int | None] | None = None
        while statuses is None:
            if time.monotonic() > deadline and not killed:
                for rank, pid in enumerate(pids):
                    try:
                        os.kill(pid, 9)
                        killed.add(rank)
                    except ProcessLookupError:
                        pass  # ended already: its status is its own
            statuses = self._reply(wait_s=1.0)
            statuses = None if statuses is None else statuses["statuses"]
        # A rank that had ended by itself before the kill (a zombie the server had not
        # reaped yet: the kill does nothing to it) keeps its own status, as with `run_ranks`.
        return [
            RankExit(
                rank,
                None if rank in killed and status == -9 else status,
                out.read_text(errors="replace"),
            )
            for rank, (status, out) in enumerate(zip(statuses, outputs, strict=True))
        ]

    def close(self) -> None:
        if self._server.stdin is not None:
            self._server.stdin.close()
        self._server.wait(timeout=30)
        self._outputs.cleanup()

    def _send(self, message: dict) -> None:
        assert self._server.stdin is not None
        self._server.stdin.write(json.dumps(message) + "\n")
        self._server.stdin.flush()

    def _reply(self, wait_s: float | None = None) -> dict | None:
        """The server's next line; None if none came within `wait_s`."""
        assert self._server.stdout is not None
        descriptor = self._server.stdout.fileno()
        while b"\n" not in self._pending:
            if wait_s is not None:
                ready, _, _ = select.select([descriptor], [], [], wait_s)
                if not ready:
                    return None
            chunk = os.read(descriptor, 65536)
            if not chunk:
                raise RuntimeError(f"the rank server ended (status {self._server.wait()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)


def _serve(module: str) -> tuple[list[str], dict] | None:
    """The server's loop: import, then fork the ranks of each request and report their exits.

    Returns only in a forked rank, with its argv and request, so that the rank runs its
    script at the top level of this file (no frame of the loop is left to unwind)."""
    importlib.import_module(module)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pids = []
        for rank in request["ranks"]:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return request["argv"], rank
            pids.append(pid)
        print(json.dumps({"pids": pids}), flush=True)
        statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(json.dumps({"statuses": statuses}), flush=True)
    return None


def _become_rank(argv: list[str], rank: dict) -> None:
    """In the forked child: the rank's environment, output file and argv."""
    os.environ.update(rank["env"])
    output = os.open(rank["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.argv = list(argv)


if __name__ == "__main__":
    child = _serve(sys.argv[1])
    if child is None:
        sys.exit(0)
    _become_rank(*child)
    runpy.run_path(sys.argv[0], run_name="__main__")
