"""The groups builder: the model's parameters laid out in flat groups, each with its record.

1. parameters built sharded by `zero.Init` are adopted (or made whole again);
2. every other parameter is laid out in flat groups (fp32 as built);
3. parameters and buffers are taken from the first rank holding the same values
   (rank 0, as DDP does; with tensor parallelism the first rank of each slice
   group: rule 4 of [Note: parallel dimensions]);
4. under mixed precision, the optimizer copy of each rank's owned range is
   kept in fp32 (the master weights), then the model is cast;
5. each group gets its record (`GroupState`): kept gradient and optimizer
   parameter when trainable, gather state when sharded (stage 3 frees the
   full buffers here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from zerodp.backward.reduction_plan import GradStorage
from zerodp.comm import Comm, broadcast_tensors
from zerodp.comm.subgroups import GroupComms
from zerodp.config import ZeroDPConfig
from zerodp.group_state import (
    GatherState,
    GroupIndex,
    GroupState,
    HostBuffers,
    KeptGradient,
    OptimizerParam,
    SecondaryShard,
)
from zerodp.offload import OffloadPolicy, OffloadStorage
from zerodp.offload.setup import (
    add_model_staging,
    check_offload_storage,
    optimizer_copies,
    place_param_shards,
)
from zerodp.optim.param_groups import ParamGroupSpec
from zerodp.optim.strategy import StageStrategy
from zerodp.partition import FlatGroup, Slicing
from zerodp.partition.builder import ModelLayout, UnitRule, build_layout
from zerodp.precision import PrecisionPolicy
from zerodp.stage3.init import adopt_init_groups
from zerodp.stage3.leaf import leaf_modules, mark_from_config
from zerodp.torch_internals import replace_buffers


@dataclass(frozen=True)
class ModelGroups:
    """What the groups builder made: the records, the layout, the offload files."""

    groups: GroupIndex
    layout: ModelLayout
    storage: OffloadStorage | None


def build_groups(
    module: nn.Module,
    config: ZeroDPConfig,
    *,
    comms: GroupComms,
    device: torch.device,
    strategy: StageStrategy,
    policy: PrecisionPolicy,
    offload: OffloadPolicy,
    specs: list[ParamGroupSpec],
    slicing: Mapping[int, Slicing] | None = None,
) -> ModelGroups:
    """`slicing`: id(param) -> its kind of slice, for the parameters that are tensor- or
    expert-parallel slices (their own groups; experts sharded over the expert-data group)."""
    zero = config.zero_optimization
    leaves = zero.leaf_module  # marked at every stage (an entry matching nothing is an error)
    mark_from_config(module, leaves.classes, leaves.names, leaves.name_suffixes)
    layout = _lay_out(module, config, comms, device, strategy, specs, slicing or {})
    _sync_from_first_rank(
        module, layout, comms.of(comms.dims.same_values_label()), device, slicing or {}
    )
    storage = None
    if offload.offloads_optimizer or offload.offloads_params:
        check_offload_storage(layout.groups, offload, comms.world)
        storage = OffloadStorage(offload, comms.world.rank)
    copies = optimizer_copies(
        layout.groups,
        mixed=policy.mixed,
        kept_dtype=policy.grad_storage_dtype,
        policy=offload,
        storage=storage,
    )
    _cast_model(module, layout, policy.param_dtype)
    add_model_staging(copies, policy.param_dtype, storage)
    if offload.offloads_params and storage is not None:
        place_param_shards(layout.groups, offload, storage)
    groups = GroupIndex(
        [
            _group_state(flat, order, strategy, policy, comms, copies.get(order))
            for order, flat in enumerate(layout.groups)
        ]
    )
    return ModelGroups(groups, layout, storage)


def _lay_out(
    module: nn.Module,
    config: ZeroDPConfig,
    comms: GroupComms,
    device: torch.device,
    strategy: StageStrategy,
    specs: list[ParamGroupSpec],
    slicing: Mapping[int, Slicing],
) -> ModelLayout:
    zero = config.zero_optimization
    comm = comms.shard
    expert = comms.expert_data
    expert_places = None if expert is None else (expert.world_size, expert.rank)
    optimizer_group = {id(p): i for i, spec in enumerate(specs) for p in spec.params}
    presharded = adopt_init_groups(
        module,
        optimizer_group,
        keep_sharded=strategy.shards_params,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        num_shards=comm.world_size,
    )
    return build_layout(
        module,
        optimizer_group,
        shard_params=strategy.shards_params,
        world_size=comm.world_size,
        rank=comm.rank,
        device=device,
        bucket_numel=zero.reduce_bucket_size,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        owns_full=strategy.optimizer_owns_full_group,
        presharded=presharded,
        units=UnitRule(
            kind=zero.stage3_units,
            numel=zero.stage3_unit_numel,
            max_block_numel=min(zero.stage3_max_live_parameters, zero.stage3_prefetch_bucket_size),
        ),
        unit_excluded=set(leaf_modules(module)),
        slicing=slicing,
        expert_places=expert_places,
    )


def _sync_from_first_rank(
    module: nn.Module,
    layout: ModelLayout,
    comm: Comm | None,
    device: torch.device,
    slicing: Mapping[int, Slicing],
) -> None:
    """Every rank starts from the parameters and buffers of the first rank of `comm`, the
    ranks holding the same values (the world, as with DDP; a slice group with tensor
    parallelism; None: this rank alone). Expert slices differ across the world: they are
    this rank's part of the model every rank took whole from rank 0 before the split, and
    stay as they are."""
    managed = {id(p) for g in layout.groups for p in g.params}
    loose = []
    for param in module.parameters():
        if id(param) not in managed:
            param.data = param.data.to(device)
            if slicing.get(id(param)) is not Slicing.EXPERT:
                loose.append(param.data)
    replace_buffers(module, lambda buffer: buffer.to(device))
    loose += list(module.buffers())
    # Groups built sharded by zero.Init were taken from rank 0 already (and are empty now).
    resident = [g for g in layout.groups if g.full_is_allocated and not g.expert]
    if comm is not None:
        broadcast_tensors(comm, [g.full for g in resident] + loose)
    for group in layout.groups:
        if group.full_is_allocated:
            group.take_shard_from_full()


def _cast_model(module: nn.Module, layout: ModelLayout, dtype: torch.dtype) -> None:
    """The model in its training dtype: flat groups, loose parameters and float buffers."""
    if dtype == torch.float32:
        return
    for group in layout.groups:
        group.cast_(dtype)
    managed = {id(p) for g in layout.groups for p in g.params}
    for param in module.parameters():
        if id(param) not in managed and param.is_floating_point():
            param.data = param.data.to(dtype)
    replace_buffers(module, lambda b: b.to(dtype) if b.is_floating_point() else b)


def _group_state(
    flat: FlatGroup,
    order: int,
    strategy: StageStrategy,
    policy: PrecisionPolicy,
    comms: GroupComms,
    copy: tuple[torch.Tensor, HostBuffers | None] | None,
) -> GroupState:
    state = GroupState(flat, order, comms.shard_of(flat))
    if flat.trainable:
        plan = strategy.reduction
        state.grads = KeptGradient(
            flat,
            covers_full=plan.storage is GradStorage.FULL,
            dtype=policy.grad_storage_dtype,
            sync=plan.initial_sync,
            release_when_zero=not plan.expose_param_grads,
        )
        state.optim = OptimizerParam(
            flat, None if copy is None else copy[0], host=None if copy is None else copy[1]
        )
    if not flat.persistent:
        secondary = None
        if comms.secondary is not None:  # hpZ: see [Note: hpZ secondary shard]
            secondary = SecondaryShard(flat.padded_numel, comms.secondary)
        state.gather = GatherState(flat, state.comm, secondary)
    return state
