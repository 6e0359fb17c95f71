"""Shared fixtures: pools of worker processes, started once per session and reused."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from zerodp.testing import WorkerPool


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
