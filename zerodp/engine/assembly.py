"""Building an engine's parts, in the order they depend on each other.

`assemble` does all of the wiring `zerodp.initialize` needs, through named builders:
1. the groups (`zerodp.engine.model_groups`): the parallel dims' process groups,
   the model laid out in flat groups taken from rank 0, cast, each with its record;
2. the backward (`zerodp.engine.backward_wiring`): the accumulation window, the
   reducer, the parameter runtime (stage 3, or its null object), the step gate
   and the autograd hooks that connect them;
3. the optimizer (`zerodp.engine.optimizers`): the torch optimizers (on the
   optimizer parameters, or on whole tensors for those that read whole tensors:
   `zerodp.optim.tensorwise`), zerodp's optimizer around them, the LR scheduler;
4. the monitors, the data loader and the post-training parts (generation,
   weight streaming, state offload);
5. with `sequence_parallel_size` > 1, the sequence-parallel parts
   (`zerodp.sequence`: attention switched, forward inputs split).

An engine with nothing to train is an inference engine (see [Note: inference
engine] in `zerodp.posttrain`): step 3 builds no optimizer of its own (one that
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

from zerodp.backward.accumulation import AccumulationWindow
from zerodp.backward.hooks import RootHooks
from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.backward.reducer import GradientReducer
from zerodp.backward.step_gate import StepGate
from zerodp.comm import Comm
from zerodp.comm.process_group import comms_timeout
from zerodp.comm.subgroups import GroupComms, group_comms
from zerodp.config import ZeroDPConfig
from zerodp.engine.backward_wiring import BackwardParts, ParamRuntime, build_backward
from zerodp.engine.composition_checks import (
    check_model_composes,
    check_optimizer_composes,
    refuse_router_aux_loss_where_refused,
)
from zerodp.engine.data_loader import ZeroDataLoader
from zerodp.engine.expert_wiring import split_experts_for_engine
from zerodp.engine.model_groups import ModelGroups, build_groups
from zerodp.engine.model_sync import take_whole_model_from_first_rank
from zerodp.engine.optimizers import OptimizerBuild, build_optimizer
from zerodp.engine.tensor_wiring import split_model, tensor_parallelism
from zerodp.expert_parallel import ExpertSplit
from zerodp.full_state.param_state import FullStateAccessor
from zerodp.group_state import GroupIndex
from zerodp.monitor.eigenvalue import EigenvalueMonitor
from zerodp.monitor.sinks import Monitor
from zerodp.monitor.training import TrainingReporter
from zerodp.offload import OffloadPolicy, OffloadStorage
from zerodp.optim.factory import optimizer_sources, steps_fused
from zerodp.optim.param_groups import resolve_param_groups
from zerodp.optim.sharded_optimizer import ZeroOptimizer
from zerodp.optim.strategy import StageStrategy, strategy_for
from zerodp.optim.tensorwise import TensorwiseStep
from zerodp.optim.torch_optimizers import OptimizerSource
from zerodp.partition import Slicing
from zerodp.posttrain import PostTraining, build_post_training
from zerodp.posttrain.mode import FrozenByEngine, InferenceReason, ModeDecision, decide_mode
from zerodp.precision import PrecisionPolicy, loss_scaler_from_config, precision_policy
from zerodp.sequence import SequenceParallel, TiledCompute, TilingSettings
from zerodp.tensor_parallel import TensorParallelism, TensorSplit
from zerodp.train_state import TrainState


class Removable(Protocol):
    """What the engine undoes at `destroy()`: hooks, frozen flags, offloaded states."""

    def remove(self) -> None: ...


@dataclass
class EngineParts:
    """Everything an engine is made of; `ZeroEngine` holds it and delegates."""

    comm: Comm
    comms: GroupComms  # the groups of every parallel dimension (see [Note: parallel dimensions])
    device: torch.device
    strategy: StageStrategy
    precision: PrecisionPolicy
    window: AccumulationWindow
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
    tensor_parallel: TensorParallelism | None  # None: no tensor parallelism
    experts: ExpertSplit | None  # None: no expert parallelism
    sequence: SequenceParallel | None  # sequence_parallel_size > 1 only


def assemble(
    module: nn.Module,
    config: ZeroDPConfig,
    *,
    comm: Comm,
    device: torch.device,
    on_forward_start: Callable[[tuple[Any, ...], dict[str, Any]], None],
    model_parameters: Any = None,
    user_optimizer: Any = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    collate_fn: Any = None,
) -> EngineParts:
    core = _training_core(
        module,
        config,
        comm=comm,
        device=device,
        on_forward_start=on_forward_start,
        model_parameters=model_parameters,
        user_optimizer=user_optimizer,
        lr_scheduler=lr_scheduler,
    )
    comms, backward, built, groups = core.comms, core.backward, core.built, core.model.groups
    optimizer = built.optimizer
    check_optimizer_composes(comms, steps_whole_tensors=built.tensorwise is not None)
    tensor = tensor_parallelism(module, config, comms, core.split, groups)
    posttrain = build_post_training(
        module=module,
        decision=core.decision,
        runtime=backward.params,
        groups=groups,
        optimizer=built.inner,
        device=device,
        gate=backward.gate,
    )
    sequence = _sequence_parallel(module, comms)
    # After the sequence hooks: its forward hooks run on the split inputs.
    tiling = _tiled_compute(module, config, backward.params.module_hooks)
    # destroy() removes the hooks, unfreezes what an inference engine froze, reloads states.
    handles: list[Removable] = [*backward.handles, *core.frozen, posttrain.offload]
    handles += [part for part in (tensor, sequence, tiling) if part is not None]
    router_check = refuse_router_aux_loss_where_refused(module, comms)
    handles += [router_check] if router_check is not None else []
    return EngineParts(
        comm=comm,
        comms=comms,
        device=device,
        strategy=core.strategy,
        precision=core.policy,
        window=core.window,
        lifecycle=backward.lifecycle,
        groups=groups,
        reducer=backward.reducer,
        params=backward.params,
        gate=backward.gate,
        train_state=core.train_state,
        inner_optimizer=built.inner,
        optimizer=optimizer,
        tensorwise=built.tensorwise,
        full_state=FullStateAccessor(
            comm=comms.shard,
            groups=groups,
            reducer=backward.reducer,
            optimizer=built.inner,
            loss_scale=lambda: optimizer.loss_scaler.scale,
            tensorwise=built.tensorwise,
        ),
        lr_scheduler=built.lr_scheduler,
        reporter=_reporter(config, comm, comms),
        eigenvalue=(
            EigenvalueMonitor(config.eigenvalue, module, comm, comms.dims)
            if config.eigenvalue.enabled
            else None
        ),
        training_dataloader=_data_loader(training_data, collate_fn, config, comms),
        handles=handles,
        root_hooks=backward.root_hooks,
        offload=core.offload,
        offload_storage=core.model.storage,
        posttrain=posttrain,
        tensor_parallel=tensor,
        experts=core.experts,
        sequence=sequence,
    )


@dataclass(frozen=True)
class _TrainingCore:
    """Steps 1-3 of the module docstring: the groups, the backward and the optimizer."""

    comms: GroupComms
    split: TensorSplit | None
    experts: ExpertSplit | None
    strategy: StageStrategy
    policy: PrecisionPolicy
    decision: ModeDecision
    frozen: list[FrozenByEngine]
    offload: OffloadPolicy
    model: ModelGroups
    train_state: TrainState
    window: AccumulationWindow
    backward: BackwardParts
    built: OptimizerBuild


def _training_core(
    module: nn.Module,
    config: ZeroDPConfig,
    *,
    comm: Comm,
    device: torch.device,
    on_forward_start: Callable[[tuple[Any, ...], dict[str, Any]], None],
    model_parameters: Any,
    user_optimizer: Any,
    lr_scheduler: Any,
) -> _TrainingCore:
    zero = config.zero_optimization
    timeout = comms_timeout(config.comms_timeout_s)
    comms, split, experts = _groups_and_splits(module, config, comm, device, timeout)
    strategy = strategy_for(zero.stage, across_replicas=comms.dims.hybrid)
    policy = precision_policy(config)
    decision = decide_mode(module, config.optimizer, user_optimizer)
    frozen = [FrozenByEngine(module)] if decision.reason is InferenceReason.NO_OPTIMIZER else []
    offload = OffloadPolicy.from_config(zero, device)
    specs, sources, step_shapes = _optimizer_sources(
        module,
        config,
        trains=decision.trains,
        model_parameters=model_parameters,
        user_optimizer=user_optimizer,
        prefer_fused=offload.offloads_optimizer or steps_fused(device),
    )
    model = build_groups(
        module,
        config,
        comms=comms,
        device=device,
        strategy=strategy,
        policy=policy,
        offload=offload,
        specs=specs,
        slicing=_slicing(module, split, experts),
    )
    train_state = TrainState()
    loss_scaler = loss_scaler_from_config(config.fp16)
    window = AccumulationWindow(
        config.batch_sizes.gradient_accumulation_steps, train_state, lambda: loss_scaler.scale
    )
    backward = build_backward(
        module,
        config,
        comms=comms,
        strategy=strategy,
        policy=policy,
        groups=model.groups,
        layout=model.layout,
        window=window,
        on_forward_start=on_forward_start,
        timeout=timeout,
    )
    built = build_optimizer(
        config,
        decision=decision,
        sources=sources,
        specs=specs,
        step_shapes=step_shapes,
        comms=comms,
        device=device,
        strategy=strategy,
        groups=model.groups,
        backward=backward,
        offload=offload,
        storage=model.storage,
        train_state=train_state,
        loss_scaler=loss_scaler,
        lr_scheduler=lr_scheduler,
    )
    return _TrainingCore(
        comms,
        split,
        experts,
        strategy,
        policy,
        decision,
        frozen,
        offload,
        model,
        train_state,
        window,
        backward,
        built,
    )


def _groups_and_splits(
    module: nn.Module,
    config: ZeroDPConfig,
    comm: Comm,
    device: torch.device,
    timeout: datetime.timedelta | None,
) -> tuple[GroupComms, TensorSplit | None, ExpertSplit | None]:
    """The process groups of every dimension, and the model split by tensor and expert
    parallelism before anything reads its parameters' shapes, each rank keeping its part of
    one model: rank 0's, taken whole first."""
    zero = config.zero_optimization
    comms = group_comms(
        comm,
        shard_size=zero.mics_shard_size,
        secondary_size=zero.zero_hpz_partition_size,
        tensor_size=config.tensor_parallel.size,
        sequence_size=config.sequence_parallel_size,
        expert_size=config.expert_parallel.size,
        timeout=timeout,
    )
    check_model_composes(module, comms)
    if comms.dims.splits_tensors or comms.dims.splits_experts:
        take_whole_model_from_first_rank(module, comms.world, device)
    split = split_model(module, config, comms, device)
    experts = split_experts_for_engine(module, config, comms)
    return comms, split, experts


def _slicing(
    module: nn.Module, split: TensorSplit | None, experts: ExpertSplit | None
) -> dict[int, Slicing]:
    """id(param) -> its kind of slice, for the parameters that are slices."""
    kinds = {} if split is None else {id(p): Slicing.TENSOR for p in split.split_params}
    if experts is not None:
        kinds.update({id(p): Slicing.EXPERT for p in module.parameters() if experts.is_expert(p)})
    return kinds


def _optimizer_sources(
    module: nn.Module,
    config: ZeroDPConfig,
    *,
    trains: bool,
    model_parameters: Any,
    user_optimizer: Any,
    prefer_fused: bool,
) -> tuple[list[Any], list[OptimizerSource], dict[str, tuple[int, ...]]]:
    """The param groups, where each torch optimizer comes from, and the shapes it steps."""
    specs = resolve_param_groups(module, model_parameters, user_optimizer)
    if not trains:
        return specs, [], {}
    return optimizer_sources(
        user_optimizer,
        config.optimizer,
        specs,
        {id(p): name for name, p in module.named_parameters()},
        prefer_fused=prefer_fused,
    )


def _reporter(config: ZeroDPConfig, comm: Comm, comms: GroupComms) -> TrainingReporter:
    return TrainingReporter(
        Monitor.from_config(config.csv_monitor, config.tensorboard, rank=comm.rank),
        active=config.csv_monitor.enabled or config.tensorboard.enabled,
        comm=comm,
        dims=comms.dims,
    )


def _sequence_parallel(module: nn.Module, comms: GroupComms) -> SequenceParallel | None:
    if comms.sequence is None:
        return None
    return SequenceParallel(module, comms.sequence, comms.dims)


def _tiled_compute(
    module: nn.Module, config: ZeroDPConfig, engine_hooks: list[RemovableHandle]
) -> TiledCompute | None:
    settings = config.tiled_compute
    if not settings.enabled:
        return None
    return TiledCompute(
        module,
        TilingSettings(settings.mlp, settings.logits_loss, settings.tile_tokens),
        engine_hooks,
    )


def _data_loader(
    training_data: Any, collate_fn: Any, config: ZeroDPConfig, comms: GroupComms
) -> ZeroDataLoader | None:
    """Ranks with the same data index read the same samples (see [Note: parallel dimensions])."""
    if training_data is None:
        return None
    return ZeroDataLoader(
        training_data,
        micro_batch_size=config.batch_sizes.train_micro_batch_size_per_gpu,
        global_batch_size=config.batch_sizes.train_batch_size,
        rank=comms.dims.data_index,
        world_size=comms.dims.data_size,
        collate_fn=collate_fn,
        drop_last=config.dataloader_drop_last,
        seed=config.seed or 0,
    )
