"""Building an engine's parts, in the order they depend on each other.

`assemble` does all of the wiring `zerodp.initialize` needs:
1. parameters built sharded by `zero.Init` are adopted (or made whole again);
2. every other parameter is laid out in flat groups (fp32 as built);
3. parameters and buffers are taken from rank 0, as DDP does;
4. under mixed precision, the optimizer copy of each rank's owned range is
   kept in fp32 (the master weights), then the model is cast;
5. each group gets its record (`GroupState`): kept gradient and optimizer
   parameter when trainable, gather state when sharded (stage 3 frees the
   full buffers here);
6. the reducer, the parameter runtime (stage 3, or its null object), the
   step gate and the autograd hooks connect them;
7. the torch optimizers (on the optimizer parameters, or on whole tensors
   for those that read whole tensors: `zerodp.optim.tensorwise`), zerodp's
   optimizer around them, the LR scheduler, the monitors and the data loader;
8. the post-training parts (generation, weight streaming, state offload).

An engine with nothing to train is an inference engine (see [Note: inference
engine] in `zerodp.posttrain`): step 7 builds no optimizer of its own (one that
refuses to step) and no scheduler.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp.backward.hooks import RootHooks, install_parameter_hooks
from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.backward.plan import GradStorage
from zerodp.backward.reducer import GradientReducer
from zerodp.backward.step_gate import StepGate
from zerodp.comm import Comm, broadcast_tensors
from zerodp.comm.group import comms_timeout
from zerodp.comm.subgroups import GroupComms, group_comms
from zerodp.config import ZeroDPConfig
from zerodp.engine.compile import apply_compile, prepare_stage3
from zerodp.engine.data_loader import ZeroDataLoader
from zerodp.engine.optimizers import scheduler_for, tensorwise_step, torch_optimizers_for
from zerodp.full_state.param_state import FullStateAccessor
from zerodp.group import (
    GatherState,
    GroupIndex,
    GroupState,
    HostBuffers,
    KeptGradient,
    OptimizerParam,
    SecondaryShard,
)
from zerodp.monitor.eigenvalue import EigenvalueMonitor
from zerodp.monitor.sinks import Monitor
from zerodp.monitor.training import TrainingReporter
from zerodp.offload import OffloadPolicy, OffloadStorage
from zerodp.offload.setup import (
    add_model_staging,
    check_offload_storage,
    optimizer_copies,
    place_param_shards,
)
from zerodp.optim.factory import optimizer_sources, steps_fused
from zerodp.optim.offloaded_step import OffloadedSteps
from zerodp.optim.param_groups import ParamGroupSpec, resolve_param_groups
from zerodp.optim.sharded_optimizer import ZeroOptimizer
from zerodp.optim.strategy import StageStrategy, strategy_for
from zerodp.optim.tensorwise import (
    TensorwiseStep,
)
from zerodp.optim.torch_optimizers import OptimizerSource
from zerodp.params.init import adopt_init_groups
from zerodp.params.leaf import leaf_modules, mark_from_config
from zerodp.params.runtime import ResidentParams, Stage3Runtime
from zerodp.partition import FlatGroup
from zerodp.partition.builder import ModelLayout, UnitRule, build_layout
from zerodp.posttrain import PostTraining, build_post_training
from zerodp.posttrain.mode import (
    FrozenByEngine,
    InferenceReason,
    decide_mode,
)
from zerodp.precision import PrecisionPolicy, loss_scaler_from_config, precision_policy
from zerodp.precision.inputs import install_input_cast
from zerodp.torch_internals import replace_buffers
from zerodp.train_state import TrainState

ParamRuntime = ResidentParams | Stage3Runtime


class Removable(Protocol):
    """What the engine undoes at `destroy()`: hooks, frozen flags, offloaded states."""

    def remove(self) -> None: ...


@dataclass
class EngineParts:
    """Everything an engine is made of; `ZeroEngine` holds it and delegates."""

    comm: Comm
    comms: GroupComms  # the shard, replica and hpZ groups (see [Note: shard groups])
    device: torch.device
    strategy: StageStrategy
    precision: PrecisionPolicy
    lifecycle: BackwardLifecycle
    groups: GroupIndex
    reducer: GradientReducer
    params: ParamRuntime
    gate: StepGate
    train_state: TrainState
    inner_optimizer: torch.optim.Optimizer
    optimizer: ZeroOptimizer
    tensorwise: TensorwiseStep | None
    full_state: FullStateAccessor
    lr_scheduler: Any
    reporter: TrainingReporter
    eigenvalue: EigenvalueMonitor | None
    training_dataloader: ZeroDataLoader | None
    handles: list[Removable]
    root_hooks: RootHooks
    offload: OffloadPolicy
    offload_storage: OffloadStorage | None
    posttrain: PostTraining


@dataclass(frozen=True)
class EngineCallbacks:
    """The engine's own reactions to lifecycle events (it counts micro-steps, so it decides)."""

    on_forward_start: Callable[[tuple[Any, ...], dict[str, Any]], None]
    is_boundary: Callable[[], bool]
    prologue_scale: Callable[[], float]


def assemble(
    module: nn.Module,
    config: ZeroDPConfig,
    *,
    comm: Comm,
    device: torch.device,
    callbacks: EngineCallbacks,
    model_parameters: Any = None,
    user_optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    collate_fn: Any = None,
) -> EngineParts:
    zero = config.zero_optimization
    timeout = comms_timeout(config.comms_timeout_s)
    comms = group_comms(
        comm,
        shard_size=zero.mics_shard_size,
        secondary_size=zero.zero_hpz_partition_size,
        timeout=timeout,
    )
    shard_comm = comms.shard
    strategy = strategy_for(zero.stage, across_replicas=comms.topology.hybrid)
    policy = precision_policy(config)
    lifecycle = BackwardLifecycle()
    decision = decide_mode(module, config.optimizer, user_optimizer)
    frozen = [FrozenByEngine(module)] if decision.reason is InferenceReason.NO_OPTIMIZER else []
    offload = OffloadPolicy.from_config(zero, device)
    specs = resolve_param_groups(module, model_parameters, user_optimizer)
    sources: list[OptimizerSource] = []
    step_shapes: dict[str, tuple[int, ...]] = {}
    if decision.trains:
        specs, sources, step_shapes = optimizer_sources(
            user_optimizer,
            config.optimizer,
            specs,
            {id(p): name for name, p in module.named_parameters()},
            prefer_fused=offload.offloads_optimizer or steps_fused(device),
        )

    leaves = zero.leaf_module  # marked at every stage (an entry matching nothing is an error)
    mark_from_config(module, leaves.classes, leaves.names, leaves.name_suffixes)
    layout = _lay_out(module, config, shard_comm, device, strategy, specs)
    _sync_from_rank0(module, layout, comm, device)
    storage = None
    if offload.offloads_optimizer or offload.offloads_params:
        check_offload_storage(layout.groups, offload, comm)
        storage = OffloadStorage(offload, comm.rank)
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

    reducer = GradientReducer(
        groups.trainable,
        shard_comm,
        strategy.reduction,
        comm_dtype=policy.comm_dtype,
        max_inflight_elements=zero.reduce_bucket_size,
        overlap_comm=zero.overlap_comm,
        replicas=comms.replica,
    )
    params: ParamRuntime
    if strategy.shards_params:
        prepare_stage3(module, config.compile)  # compiled blocks are leaves: marked before hooks
        params = Stage3Runtime(
            module,
            groups,
            layout.module_params,
            comms,
            lifecycle,
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            max_live_numel=zero.stage3_max_live_parameters,
            max_reuse_distance=zero.stage3_max_reuse_distance,
            reducer=reducer,
            check_order=zero.stage3_check_order,
            order_timeout_s=_seconds(timeout),
        )
    else:
        params = ResidentParams(
            groups, shard_comm, publish_after_step=strategy.gathers_params_after_step
        )
    gate = StepGate(
        lifecycle, reducer, release_gathered=params.release_all, on_non_finite=config.on_non_finite
    )
    hook_handles, root_hooks = _connect(
        module, groups, lifecycle, reducer, params, gate, policy, callbacks
    )
    apply_compile(module, config.compile, zero.stage)

    train_state = TrainState()

    def make_tensorwise(states: list[GroupState]) -> TensorwiseStep:
        return tensorwise_step(states, config, shard_comm, device, step_shapes)

    parts = torch_optimizers_for(decision, sources, specs, groups, offload, make_tensorwise)
    inner = parts.inner
    optimizer = ZeroOptimizer(
        parts,
        reducer=reducer,
        comm=shard_comm,  # a norm counts each shard once: replicas hold copies
        states=groups.trainable,
        sharded_grads=strategy.shards_optimizer_state,
        params=params,
        model_params=groups.params,
        gradient_clipping=config.gradient_clipping,
        gate=gate,
        train_state=train_state,
        loss_scaler=loss_scaler_from_config(config.fp16),
        offload=(
            OffloadedSteps(offload, storage)
            if storage is not None and offload.offloads_optimizer
            else None
        ),
        device=device,
    )
    posttrain = build_post_training(
        module=module,
        decision=decision,
        runtime=params,
        groups=groups,
        optimizer=inner,
        device=device,
        gate=gate,
    )
    # destroy() removes the hooks, unfreezes what an inference engine froze, reloads states.
    handles: list[Removable] = [*hook_handles, *frozen, posttrain.offload]
    return EngineParts(
        comm=comm,
        comms=comms,
        device=device,
        strategy=strategy,
        precision=policy,
        lifecycle=lifecycle,
        groups=groups,
        reducer=reducer,
        params=params,
        gate=gate,
        train_state=train_state,
        inner_optimizer=inner,
        optimizer=optimizer,
        tensorwise=parts.tensorwise,
        full_state=FullStateAccessor(
            comm=shard_comm,
            groups=groups,
            reducer=reducer,
            optimizer=inner,
            loss_scale=lambda: optimizer.loss_scaler.scale,
            tensorwise=parts.tensorwise,
        ),
        lr_scheduler=(
            scheduler_for(lr_scheduler, config, inner, optimizer) if decision.trains else None
        ),
        reporter=TrainingReporter(
            Monitor.from_config(config.csv_monitor, config.tensorboard, rank=comm.rank),
            active=config.csv_monitor.enabled or config.tensorboard.enabled,
            comm=comm,
        ),
        eigenvalue=(
            EigenvalueMonitor(config.eigenvalue, module, comm)
            if config.eigenvalue.enabled
            else None
        ),
        training_dataloader=_data_loader(training_data, collate_fn, config, comm),
        handles=handles,
        root_hooks=root_hooks,
        offload=offload,
        offload_storage=storage,
        posttrain=posttrain,
    )


# -- the model's tensors ---------------------------------------------------------------


def _lay_out(
    module: nn.Module,
    config: ZeroDPConfig,
    comm: Comm,
    device: torch.device,
    strategy: StageStrategy,
    specs: list[ParamGroupSpec],
) -> ModelLayout:
    zero = config.zero_optimization
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
    replace_buffers(module, lambda buffer: buffer.to(device))
    loose += list(module.buffers())
    # Groups built sharded by zero.Init were taken from rank 0 already (and are empty now).
    resident = [g for g in layout.groups if g.full_is_allocated]
    broadcast_tensors(comm, [g.full for g in resident] + loose)
    for group in resident:
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
    state = GroupState(flat, order)
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
        state.gather = GatherState(flat, comms.shard, secondary)
    return state


# -- hooks ---------------------------------------------------------------------------------


def _connect(
    module: nn.Module,
    groups: GroupIndex,
    lifecycle: BackwardLifecycle,
    reducer: GradientReducer,
    params: ParamRuntime,
    gate: StepGate,
    policy: PrecisionPolicy,
    callbacks: EngineCallbacks,
) -> tuple[list[RemovableHandle], RootHooks]:
    """Connect autograd to the lifecycle, the lifecycle to the reducer and the gate."""

    def prologue(task: Any) -> None:
        reducer.begin_task(
            is_boundary=callbacks.is_boundary(), contribution_scale=callbacks.prologue_scale()
        )

    def epilogue(task: Any) -> None:
        reducer.end_task()
        params.after_backward()
        gate.on_task_end(task)

    def abort(task: Any) -> None:
        reducer.abort_task()
        gate.on_task_abort(task)

    handles = install_parameter_hooks(groups.trainable, lifecycle, reducer)
    root_hooks = RootHooks(module, lifecycle, callbacks.on_forward_start)
    handles += root_hooks.handles
    if policy.mixed:
        handles.append(install_input_cast(module, policy.param_dtype))
    handles += [
        lifecycle.on_prologue(prologue),
        lifecycle.on_epilogue(epilogue),
        lifecycle.on_abort(abort),
        reducer.on_contributions_complete.connect(params.on_grads_complete),
    ]
    return handles, root_hooks


def _data_loader(
    training_data: Any, collate_fn: Any, config: ZeroDPConfig, comm: Comm
) -> ZeroDataLoader | None:
    if training_data is None:
        return None
    return ZeroDataLoader(
        training_data,
        micro_batch_size=config.batch_sizes.train_micro_batch_size_per_gpu,
        rank=comm.rank,
        world_size=comm.world_size,
        collate_fn=collate_fn,
        drop_last=config.dataloader_drop_last,
        seed=config.seed or 0,
    )


def _seconds(timeout: datetime.timedelta | None) -> float | None:
    return None if timeout is None else timeout.total_seconds()
