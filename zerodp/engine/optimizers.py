"""The optimizer builder: an engine's torch optimizers (flat shards or whole tensors, see
`zerodp.optim.tensorwise`), zerodp's optimizer around them, and its LR scheduler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerodp.comm import Comm
from zerodp.comm.subgroups import GroupComms
from zerodp.config import ZeroDPConfig
from zerodp.engine.backward_wiring import BackwardParts
from zerodp.errors import ConfigError
from zerodp.group_state import GroupIndex, GroupState
from zerodp.offload import OffloadPolicy, OffloadStorage, Placement
from zerodp.optim.grad_norm import NormReduction
from zerodp.optim.offloaded_step import OffloadedSteps
from zerodp.optim.param_groups import ParamGroupSpec
from zerodp.optim.schedulers import build_scheduler
from zerodp.optim.sharded_optimizer import ZeroOptimizer
from zerodp.optim.strategy import StageStrategy
from zerodp.optim.tensorwise import GroupLayout, OwnerPlacement, TensorwiseStep, build_plan
from zerodp.optim.torch_optimizers import (
    OptimizerSource,
    TorchOptimizers,
    WholeTensorStepRefusedError,
    build_torch_optimizers,
)
from zerodp.parallel.composition import Feature, refusal_for
from zerodp.posttrain.mode import InferenceOptimizer, ModeDecision, refusal_message
from zerodp.precision.loss_scaler import LossScaler
from zerodp.train_state import TrainState


@dataclass(frozen=True)
class OptimizerBuild:
    """What the optimizer builder made."""

    optimizer: ZeroOptimizer
    inner: torch.optim.Optimizer  # the torch optimizer (or `OptimizerChain`) it steps
    tensorwise: TensorwiseStep | None
    lr_scheduler: Any


def build_optimizer(
    config: ZeroDPConfig,
    *,
    decision: ModeDecision,
    sources: list[OptimizerSource],
    specs: list[ParamGroupSpec],
    step_shapes: dict[str, tuple[int, ...]],
    comms: GroupComms,
    device: torch.device,
    strategy: StageStrategy,
    groups: GroupIndex,
    backward: BackwardParts,
    offload: OffloadPolicy,
    storage: OffloadStorage | None,
    train_state: TrainState,
    loss_scaler: LossScaler,
    lr_scheduler: Any,
) -> OptimizerBuild:
    def make_tensorwise(states: list[GroupState]) -> TensorwiseStep:
        refused = refusal_for(Feature.WHOLE_TENSOR_OPTIMIZERS, comms.dims)
        if refused is not None:  # every rank alike: the dims and the optimizer are shared
            raise WholeTensorStepRefusedError(refused)
        return tensorwise_step(states, config, comms.shard, device, step_shapes)

    torch_optimizers = torch_optimizers_for(
        decision, sources, specs, groups, offload, make_tensorwise
    )
    inner = torch_optimizers.inner
    optimizer = ZeroOptimizer(
        torch_optimizers,
        reducer=backward.reducer,
        norms=NormReduction.per_slicing(comms, sharded=strategy.shards_optimizer_state),
        states=groups.trainable,
        params=backward.params,
        model_params=groups.params,
        gradient_clipping=config.gradient_clipping,
        gate=backward.gate,
        train_state=train_state,
        comm=comms.world,
        loss_scaler=loss_scaler,
        offload=(
            OffloadedSteps(offload, storage)
            if storage is not None and offload.offloads_optimizer
            else None
        ),
        device=device,
    )
    scheduler = scheduler_for(lr_scheduler, config, inner, optimizer) if decision.trains else None
    return OptimizerBuild(optimizer, inner, torch_optimizers.tensorwise, scheduler)


def torch_optimizers_for(
    decision: ModeDecision,
    sources: list[OptimizerSource],
    specs: list[ParamGroupSpec],
    groups: GroupIndex,
    offload: OffloadPolicy,
    make_tensorwise: Callable[[list[GroupState]], TensorwiseStep],
) -> TorchOptimizers:
    """The torch optimizers on the trainable groups; an inference engine's refuses to step."""
    if not decision.trains:
        return TorchOptimizers(
            members=[],
            inner=InferenceOptimizer(refusal_message(decision, "optimizer.step()")),
            tensorwise=None,
        )
    optimizers = build_torch_optimizers(
        sources, [spec.options for spec in specs], groups.trainable, make_tensorwise
    )
    if optimizers.tensorwise is not None and offload.optimizer is Placement.FILE:
        raise ConfigError(
            "an optimizer that reads whole tensors (Muon, Adafactor, any optimizer zerodp does "
            "not know as elementwise) keeps its state with the rank that steps each tensor, "
            "which NVMe optimizer offload does not support; use "
            '"offload_optimizer": {"device": "cpu"} or none'
        )
    return optimizers


def tensorwise_step(
    states: list[GroupState],
    config: ZeroDPConfig,
    comm: Comm,
    device: torch.device,
    step_shapes: dict[str, tuple[int, ...]],
) -> TensorwiseStep:
    """The whole-tensor step for `states`' groups (see [Note: tensor-wise step])."""
    layouts = [
        GroupLayout(
            order=state.order,
            names=tuple(state.names),
            layout=state.flat.layout,
            owns_full=state.flat.owns_full,
            values_resident=state.persistent
            and state.optim is not None
            and state.optim.copy is None,
        )
        for state in states
    ]
    placement = OwnerPlacement(config.zero_optimization.tensorwise_placement)
    return TensorwiseStep(build_plan(layouts, placement, step_shapes), states, comm, device)


def scheduler_for(
    lr_scheduler: Any,
    config: ZeroDPConfig,
    inner: torch.optim.Optimizer,
    optimizer: ZeroOptimizer,
) -> Any:
    if lr_scheduler is None:
        if config.scheduler is None:
            return None
        return build_scheduler(optimizer, config.scheduler)
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        if lr_scheduler.optimizer is not inner and lr_scheduler.optimizer is not optimizer:
            raise ValueError(
                "lr_scheduler is bound to an optimizer zerodp does not step; pass the "
                "optimizer it was built on to zerodp.initialize too, or pass a callable "
                "lr_scheduler(optimizer) -> scheduler"
            )
        return lr_scheduler
    if callable(lr_scheduler):
        return lr_scheduler(optimizer)
    raise TypeError("lr_scheduler must be an LRScheduler, a callable(optimizer), or None")
