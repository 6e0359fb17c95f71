"""Test helpers: run a function on N real processes, and the data-parallel reference."""

from zerodp.testing.dist import DistributedTestError, WorkerPool, free_port, run_distributed
from zerodp.testing.reference import ReferenceDP

__all__ = ["DistributedTestError", "ReferenceDP", "WorkerPool", "free_port", "run_distributed"]
