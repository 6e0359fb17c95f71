"""The ZeRO stage, decided once: what each stage shards and how it reduces.

This is the one place that branches on the stage number. Everything else asks
the `StageStrategy` a question ("are parameters sharded?", "where are
gradients kept?") and never compares stage numbers itself.

stage 0: optimizer state full; gradients kept full and averaged (all-reduce
         at the accumulation boundary); parameters full.
stage 1: optimizer state sharded; gradients kept full, local until the
         boundary, where each rank reduce-scatters its shard; parameters
         full, all-gathered after the step.
stage 2: optimizer state and gradients sharded (reduce-scatter in every
         backward); parameters full, all-gathered after the step.
stage 3: all three sharded; parameters gathered only while in use.

With shard groups that replicate each other (`mics_shard_size`, see [Note:
shard groups] in `zerodp.comm.topology`) stages 1-3 shard within the shard
group and average gradients across replicas at the boundary
(`ReductionPlan.across_replicas`); stage 0 shards nothing and refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.backward.reduction_plan import FullReduce, GradStorage, ReductionPlan


@dataclass(frozen=True)
class StageStrategy:
    stage: int
    reduction: ReductionPlan
    optimizer_owns_full_group: bool  # stage 0: each rank steps whole groups
    shards_optimizer_state: bool
    shards_params: bool  # stage 3: full parameters exist only while in use
    gathers_params_after_step: bool  # stages 1, 2 (and stage 3's persistent parameters)


def _plan(
    storage: GradStorage, full_reduce: FullReduce, stage: int, across_replicas: bool = False
) -> ReductionPlan:
    return ReductionPlan(
        storage=storage,
        full_reduce=full_reduce,
        defer_to_boundary=storage is GradStorage.FULL,
        expose_param_grads=stage == 0,
        across_replicas=across_replicas,
    )


def strategy_for(stage: int, across_replicas: bool = False) -> StageStrategy:
    """The strategy of `stage`; `across_replicas`: shard groups replicate each other."""
    if across_replicas and stage == 0:
        raise ValueError("stage 0 shards nothing: it has no shard groups to replicate")
    if stage == 0:
        return StageStrategy(
            stage=0,
            reduction=_plan(GradStorage.FULL, FullReduce.ALL_REDUCE, stage),
            optimizer_owns_full_group=True,
            shards_optimizer_state=False,
            shards_params=False,
            gathers_params_after_step=False,
        )
    if stage in (1, 2, 3):
        storage = GradStorage.FULL if stage == 1 else GradStorage.SHARD
        return StageStrategy(
            stage=stage,
            reduction=_plan(storage, FullReduce.REDUCE_SCATTER, stage, across_replicas),
            optimizer_owns_full_group=False,
            shards_optimizer_state=True,
            shards_params=stage == 3,
            gathers_params_after_step=True,
        )
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
