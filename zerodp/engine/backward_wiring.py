"""The backward builder: reducer, parameter runtime (stage 3, or its null object), step gate,
and the autograd hooks that connect them to the lifecycle.

Each object gets what it works with at construction (see [Note: gradient
reduction], [Note: backward lifecycle]); this module only decides the order they
are built in and which signal reaches which.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp.backward.accumulation import AccumulationWindow
from zerodp.backward.hooks import RootHooks, install_parameter_hooks
from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.backward.reducer import GradientReducer
from zerodp.backward.step_gate import StepGate
from zerodp.comm.subgroups import GroupComms
from zerodp.config import ZeroDPConfig
from zerodp.engine.compile import apply_compile, prepare_stage3
from zerodp.group_state import GroupIndex
from zerodp.optim.strategy import StageStrategy
from zerodp.partition.builder import ModelLayout
from zerodp.precision import PrecisionPolicy
from zerodp.precision.input_casting import install_input_cast
from zerodp.stage3.runtime import ResidentParams, Stage3Runtime, collective_order_for

ParamRuntime = ResidentParams | Stage3Runtime
ForwardStart = Callable[[tuple[Any, ...], dict[str, Any]], None]


@dataclass(frozen=True)
class BackwardParts:
    """What the backward builder made, and the handles `destroy()` removes."""

    lifecycle: BackwardLifecycle
    reducer: GradientReducer
    params: ParamRuntime
    gate: StepGate
    root_hooks: RootHooks
    handles: list[RemovableHandle]


def build_backward(
    module: nn.Module,
    config: ZeroDPConfig,
    *,
    comms: GroupComms,
    strategy: StageStrategy,
    policy: PrecisionPolicy,
    groups: GroupIndex,
    layout: ModelLayout,
    window: AccumulationWindow,
    on_forward_start: ForwardStart,
    timeout: datetime.timedelta | None,
) -> BackwardParts:
    zero = config.zero_optimization
    lifecycle = BackwardLifecycle()
    order = (  # stage 3's collective order check: the reducer's and the gathers' collectives
        collective_order_for(
            module,
            groups,
            comms.world,
            check=zero.stage3_check_order,
            timeout_s=None if timeout is None else timeout.total_seconds(),
        )
        if strategy.shards_params
        else None
    )
    reducer = GradientReducer(
        groups.trainable,
        comms.shard,
        strategy.reduction,
        comms.dims,
        window,
        comm_dtype=policy.comm_dtype,
        max_inflight_elements=zero.reduce_bucket_size,
        overlap_comm=zero.overlap_comm,
        replicas=comms.replica,
        order=order,
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
            order=order,
        )
    else:
        params = ResidentParams(groups, publish_after_step=strategy.gathers_params_after_step)
    gate = StepGate(
        lifecycle, reducer, release_gathered=params.release_all, on_non_finite=config.on_non_finite
    )
    handles, root_hooks = _connect(
        module, groups, lifecycle, reducer, params, gate, policy, on_forward_start
    )
    apply_compile(module, config.compile, zero.stage)
    return BackwardParts(lifecycle, reducer, params, gate, root_hooks, handles)


def _connect(
    module: nn.Module,
    groups: GroupIndex,
    lifecycle: BackwardLifecycle,
    reducer: GradientReducer,
    params: ParamRuntime,
    gate: StepGate,
    policy: PrecisionPolicy,
    on_forward_start: ForwardStart,
) -> tuple[list[RemovableHandle], RootHooks]:
    """Connect autograd to the lifecycle, the lifecycle to the reducer and the gate."""

    def epilogue(task: Any) -> None:
        reducer.end_task()
        params.after_backward()
        gate.on_task_end(task)

    def abort(task: Any) -> None:
        reducer.abort_task()
        gate.on_task_abort(task)

    handles = install_parameter_hooks(groups.trainable, lifecycle, reducer)
    root_hooks = RootHooks(module, lifecycle, on_forward_start)
    handles += root_hooks.handles
    if policy.mixed:
        handles.append(install_input_cast(module, policy.param_dtype))
    handles += [
        lifecycle.on_prologue(lambda task: reducer.begin_task()),
        lifecycle.on_epilogue(epilogue),
        lifecycle.on_abort(abort),
        reducer.on_contributions_complete.connect(params.on_grads_complete),
    ]
    return handles, root_hooks
