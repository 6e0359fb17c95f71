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
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.backward.reducer import FullReduce, GradStorage, ReductionPlan


@dataclass(frozen=True)
class StageStrategy:
    stage: int
    reduction: ReductionPlan
    shards_optimizer_state: bool
    shards_params: bool  # stage 3: full parameters exist only while in use
    gathers_params_after_step: bool  # stages 1, 2 (and stage 3's persistent parameters)

    @property
    def name(self) -> str:
        return f"ZeRO stage {self.stage}"


def strategy_for(stage: int) -> StageStrategy:
    if stage == 0:
        return StageStrategy(
            stage=0,
            reduction=ReductionPlan(
                storage=GradStorage.FULL,
                full_reduce=FullReduce.ALL_REDUCE,
                defer_to_boundary=True,
                expose_param_grads=True,
                optimizer_owns_full_group=True,
            ),
            shards_optimizer_state=False,
            shards_params=False,
            gathers_params_after_step=False,
        )
    if stage == 1:
        return StageStrategy(
            stage=1,
            reduction=ReductionPlan(
                storage=GradStorage.FULL,
                full_reduce=FullReduce.REDUCE_SCATTER,
                defer_to_boundary=True,
                expose_param_grads=False,
                optimizer_owns_full_group=False,
            ),
            shards_optimizer_state=True,
            shards_params=False,
            gathers_params_after_step=True,
        )
    if stage in (2, 3):
        return StageStrategy(
            stage=stage,
            reduction=ReductionPlan(
                storage=GradStorage.SHARD,
                full_reduce=FullReduce.REDUCE_SCATTER,
                defer_to_boundary=False,
                expose_param_grads=False,
                optimizer_owns_full_group=False,
            ),
            shards_optimizer_state=True,
            shards_params=stage == 3,
            gathers_params_after_step=True,
        )
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
