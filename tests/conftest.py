"""Shared fixtures: pools of worker processes, started once per session and reused."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from zerodp.testing import WorkerPool

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
