"""Run a test function on N real processes (gloo on 127.0.0.1), reusing them across tests.

Starting a process costs seconds (importing torch), so a `WorkerPool` starts
its N workers once, sets up the process group once, and then runs one
function after another on all of them. A failing rank's traceback is raised
in the test; a rank that does not answer in time (a hang in a collective)
fails the test with a timeout, its stack is dumped to stderr, and the pool is
torn down so the next test gets fresh processes. Functions must be
importable (module-level) and their arguments and results picklable.

A task (and the process group's set-up) that makes zerodp call an API its library
deprecates fails with `DeprecationCausedError`, naming zerodp's line: the warning torch or
transformers raises then is what a user's run would print (`zerodp.testing.caused_warnings`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from zerodp.testing.caused_warnings import deprecations_caused_by_zerodp, describe

_GRACE_AFTER_FAILURE_S = 10.0


class DeprecationCausedError(AssertionError):
    """zerodp's code called an API that its library deprecates (the task's result is moot)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }


def _worker_main(
    rank: int, world_size: int, port: int, tasks: Any, results: Any, env: dict[str, str]
) -> None:
    os.environ.update(worker_env(rank, world_size, port))
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    from zerodp.comm import ensure_process_group

    try:
        with deprecations_caused_by_zerodp(show_all=True) as caused:
            ensure_process_group(
                timeout_s=None if os.environ.get("ZERODP_COMMS_TIMEOUT_S") else 600
            )
        if caused:
            raise DeprecationCausedError(describe(caused))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    # Each task starts from this environment: a tool under test may change it (Lightning's
    # teardown deletes WORLD_SIZE), which would reach the next task of the same worker.
    environment = dict(os.environ)
    while True:
        task = tasks.get()
        if task is None:
            break
        if os.environ != environment:
            os.environ.clear()
            os.environ.update(environment)
        module_name, qualname, args, kwargs, timeout_s = task
        faulthandler.dump_traceback_later(max(1.0, timeout_s - 2.0), exit=False)
        try:
            with deprecations_caused_by_zerodp(show_all=True) as caused:
                fn: Any = importlib.import_module(module_name)
                for part in qualname.split("."):
                    fn = getattr(fn, part)
                result = fn(*args, **kwargs)
            if caused:
                raise DeprecationCausedError(describe(caused))
            results.put((rank, True, result))
        except BaseException:
            results.put((rank, False, f"rank {rank}:\n{traceback.format_exc()}"))
        finally:
            faulthandler.cancel_dump_traceback_later()
    from zerodp.comm import destroy_process_group_if_owned

    destroy_process_group_if_owned()


class DistributedTestError(AssertionError):
    """A rank raised, or did not answer in time."""


class WorkerPool:
    def __init__(self, world_size: int, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.env = env or {}
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, self._tasks[rank], self._results, self.env),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float = 180.0, **kwargs: Any
    ) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        if not self.alive:
            self.close()
            self.start()
        module_name = fn.__module__
        if module_name == "__main__":
            raise ValueError("distributed test functions must live in an importable module")
        task = (module_name, fn.__qualname__, args, kwargs, timeout_s)
        for tasks in self._tasks:
            tasks.put(task)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) + len(failures) < self.world_size:
            remaining = deadline - time.monotonic()
            if failures:
                remaining = min(remaining, _GRACE_AFTER_FAILURE_S)
            try:
                rank, ok, payload = self._results.get(timeout=max(0.1, remaining))
            except queue.Empty:
                break
            if ok:
                results[rank] = payload
            else:
                failures[rank] = payload
            if not self.alive and len(results) + len(failures) < self.world_size:
                time.sleep(0.5)
                if self._results.empty():
                    break
        missing = [r for r in range(self.world_size) if r not in results and r not in failures]
        if missing or failures:
            self.close()
            message = [f"{fn.__qualname__} failed on {self.world_size} ranks"]
            message += [failures[r] for r in sorted(failures)]
            if missing:
                message.append(
                    f"ranks {missing} did not finish within {timeout_s:.0f}s "
                    "(hung in a collective, or crashed; their stacks went to stderr)"
                )
            raise DistributedTestError("\n".join(message))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for tasks, proc in zip(self._tasks, self._procs, strict=False):
            if proc.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = []
        self._tasks = []


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn` once on `world_size` fresh processes."""
    pool = WorkerPool(world_size, env=env)
    try:
        return pool.run(fn, *args, timeout_s=timeout_s, **kwargs)
    finally:
        pool.close()
