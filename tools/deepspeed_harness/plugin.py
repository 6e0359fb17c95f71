"""pytest plugin: each method of a `DistributedTest` subclass runs on `world_size` ranks.

The test's parameters are passed to every rank; a rank's exception fails the test with
that rank's traceback; a skip on the ranks skips it. One pool of processes per world size
serves every test (zerodp.testing.WorkerPool), as DeepSpeed's harness can reuse its pool.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from deepspeed_harness import alias
from unit.common import DistributedTest

from zerodp.testing import WorkerPool

TIMEOUT_S = float(os.environ.get("DS_HARNESS_TIMEOUT_S", "240"))
_pools: dict[int, WorkerPool] = {}

alias.install(
    cpu_ddp=os.environ.get("DS_HARNESS_CPU_DDP") == "1",
    fp32=os.environ.get("DS_HARNESS_FP32") == "1",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sequential: DeepSpeed's marker (runs as any other)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Any:
    instance = pyfuncitem.instance
    if not isinstance(instance, DistributedTest):
        return None
    world_size = int(getattr(instance, "world_size", 2))
    if world_size not in _pools:
        _pools[world_size] = WorkerPool(world_size)
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    module = pyfuncitem.module
    folder = os.path.dirname(module.__file__)
    results = _pools[world_size].run(
        _run_test(),
        folder,
        module.__name__,
        type(instance).__name__,
        pyfuncitem.originalname,
        kwargs,
        timeout_s=TIMEOUT_S,
    )
    skipped = [why for outcome, why in results if outcome == "skipped"]
    if skipped:
        pytest.skip(skipped[0])
    return True


def _run_test() -> Any:
    from deepspeed_harness.worker import run_test

    return run_test


def pytest_sessionfinish(session: pytest.Session) -> None:
    for pool in _pools.values():
        pool.close()
