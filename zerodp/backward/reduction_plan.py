"""How a stage reduces its gradients: what each rank keeps, and when it is averaged.

Decided once by the stage strategy (`zerodp.optim.strategy`) and read by the
reducer (see [Note: gradient reduction] in `zerodp.backward.reducer`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from zerodp.group_state import GradSync


class GradStorage(enum.Enum):
    """How much of a group's gradient each rank keeps."""

    FULL = "full"  # the whole group (stages 0, 1)
    SHARD = "shard"  # this rank's shard (stages 2, 3)


class FullReduce(enum.Enum):
    """How a full kept gradient is reduced at the boundary."""

    ALL_REDUCE = "all_reduce"  # stage 0: the whole buffer is averaged everywhere
    REDUCE_SCATTER = "reduce_scatter"  # stage 1: each rank averages its own shard


@dataclass(frozen=True)
class ReductionPlan:
    storage: GradStorage
    full_reduce: FullReduce
    defer_to_boundary: bool  # LOCAL accumulation between boundaries (stages 0, 1)
    expose_param_grads: bool  # `param.grad` shows the kept gradient (stage 0)
    across_replicas: bool = False  # shard groups replicate each other: PARTIAL until a boundary

    @property
    def initial_sync(self) -> GradSync:
        if self.defer_to_boundary:
            return GradSync.LOCAL
        return GradSync.PARTIAL if self.across_replicas else GradSync.AVERAGED

    @property
    def reduces_whole_buffer(self) -> bool:
        return self.storage is GradStorage.FULL and self.full_reduce is FullReduce.ALL_REDUCE
