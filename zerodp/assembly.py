"""Assembling a model's training state: layout, precision, stage 3, reducer, optimizer shards.

`assemble` runs the set-up steps in the order they depend on each other:
1. parameters built sharded by `zero.Init` are adopted (or made whole again);
2. every other parameter is laid out in flat groups (fp32 as built);
3. parameters and buffers are taken from rank 0, as DDP does;
4. under mixed precision, the fp32 master of each rank's owned range is kept
   and the model is cast to half precision;
5. stage 3 frees the full buffers and starts gathering on use;
6. the gradient reducer, and the optimizer's parameters (the owned ranges,
   or their masters), are created.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.backward.reducer import GradientReducer, GroupGradients
from zerodp.comm import Comm, broadcast_tensors
from zerodp.config import ZeroDPConfig
from zerodp.optim.factory import build_optimizer, shard_parameter
from zerodp.optim.param_groups import ParamGroupSpec
from zerodp.optim.strategy import StageStrategy
from zerodp.params.init import adopt_init_groups
from zerodp.params.runtime import Stage3Runtime
from zerodp.partition.builder import ModelLayout, build_layout
from zerodp.precision.master import MasterWeights
from zerodp.precision.policy import PrecisionPolicy


@dataclass
class ModelState:
    layout: ModelLayout
    stage3: Stage3Runtime | None
    reducer: GradientReducer
    masters: MasterWeights | None
    shards: list[tuple[GroupGradients, nn.Parameter]]
    inner_optimizer: torch.optim.Optimizer

    @property
    def managed_params(self) -> list[nn.Parameter]:
        return [p for g in self.layout.groups for p in g.params]

    @property
    def trainable_params(self) -> list[nn.Parameter]:
        return [p for g in self.layout.groups if g.trainable for p in g.params]


def assemble(
    module: nn.Module,
    config: ZeroDPConfig,
    *,
    comm: Comm,
    device: torch.device,
    strategy: StageStrategy,
    policy: PrecisionPolicy,
    lifecycle: BackwardLifecycle,
    specs: list[ParamGroupSpec],
    user_optimizer: Any,
) -> ModelState:
    zero = config.zero_optimization
    trainable_groups = {id(p): i for i, spec in enumerate(specs) for p in spec.params}
    presharded = adopt_init_groups(
        module,
        trainable_groups,
        keep_sharded=strategy.shards_params,
        persistence_threshold=zero.stage3_param_persistence_threshold,
    )
    layout = build_layout(
        module,
        trainable_groups,
        shard_params=strategy.shards_params,
        world_size=comm.world_size,
        rank=comm.rank,
        device=device,
        bucket_numel=zero.reduce_bucket_size,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        presharded=presharded,
    )
    _sync_from_rank0(module, layout, comm, device)
    owns_full = strategy.reduction.optimizer_owns_full_group
    masters = _cast_to(module, layout, policy, owns_full) if policy.mixed else None

    stage3 = None
    if strategy.shards_params:
        stage3 = Stage3Runtime(
            module,
            layout,
            comm,
            lifecycle,
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
        )
    reducer = GradientReducer(
        layout.groups,
        comm,
        strategy.reduction,
        storage_dtype=policy.grad_storage_dtype,
        comm_dtype=policy.comm_dtype,
        max_inflight_elements=zero.reduce_bucket_size,
        overlap_comm=zero.overlap_comm,
    )
    if stage3 is not None:
        reducer.on_group_complete.append(stage3.coordinator.on_grads_complete)

    shards = []
    shard_groups: list[dict[str, Any]] = [{"params": [], **spec.options} for spec in specs]
    for grads in reducer.groups:
        group = grads.group
        owned = group.full if owns_full else group.shard
        master = masters.master_of(group) if masters is not None else None
        shard = shard_parameter(master if master is not None else owned)
        shards.append((grads, shard))
        shard_groups[group.param_group_index]["params"].append(shard)
    inner = build_optimizer(user_optimizer, config.optimizer, shard_groups)
    return ModelState(
        layout=layout,
        stage3=stage3,
        reducer=reducer,
        masters=masters,
        shards=shards,
        inner_optimizer=inner,
    )


def _sync_from_rank0(
    module: nn.Module, layout: ModelLayout, comm: Comm, device: torch.device
) -> None:
    """Every rank starts from rank 0's parameters and buffers, as with DDP."""
    managed = {id(p) for g in layout.groups for p in g.params}
    loose = []
    for param in module.parameters():
        if id(param) not in managed:
            param.data = param.data.to(device)
            loose.append(param.data)
    for owner in module.modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                moved = buffer.to(device)
                owner._buffers[name] = moved
                loose.append(moved)
    # Groups built sharded by zero.Init were taken from rank 0 already (and are empty now).
    resident = [g for g in layout.groups if g.full_is_allocated]
    broadcast_tensors(comm, [g.full for g in resident] + loose)
    for group in resident:
        group.take_shard_from_full()


def _cast_to(
    module: nn.Module, layout: ModelLayout, policy: PrecisionPolicy, owns_full: bool
) -> MasterWeights:
    """Keep fp32 masters of the owned ranges, then cast the model to half precision."""
    masters = MasterWeights()
    for group in layout.groups:
        if group.trainable:
            owned = group.full if owns_full else group.shard
            masters.add(group, owned.detach().to(torch.float32).clone(), owns_full)
        group.cast_(policy.param_dtype)
    managed = {id(p) for g in layout.groups for p in g.params}
    for param in module.parameters():
        if id(param) not in managed and param.is_floating_point():
            param.data = param.data.to(policy.param_dtype)
    for owner in module.modules():
        for name, buffer in owner._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                owner._buffers[name] = buffer.to(policy.param_dtype)
    return masters
