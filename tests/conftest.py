"""Shared fixtures: pools of worker processes, started once per session and reused."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from zerodp.testing import WorkerPool
from zerodp.testing.caused_warnings import deprecations_caused_by_zerodp, describe

# Nothing in the tests may reach the network (TRL's trainers report usage to the Hub); the
# worker processes inherit this.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def pools() -> Iterator[Callable[[int], WorkerPool]]:
    cache: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in cache:
            cache[world_size] = WorkerPool(world_size)
        return cache[world_size]

    yield get
    for pool in cache.values():
        pool.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test fails when zerodp's code called an API its library deprecates.

    pyproject.toml's filters make a deprecation warning attributed to a `zerodp` module an
    error; this also catches those that torch or transformers attribute to themselves while
    zerodp made the call (`zerodp.testing.caused_warnings`). The pool's workers check their
    tasks the same way (`zerodp.testing.dist`).
    """
    with deprecations_caused_by_zerodp() as caused:
        result = yield
    if caused:
        pytest.fail(describe(caused), pytrace=False)
    return result
