"""Splitting a model for the engine: the checks that need the run, the model taken from rank 0,
the split, and the parts the engine keeps (`TensorParallelism`).

`split_for_engine` runs before the engine lays out its flat groups, on a model every
rank took whole from rank 0, so each
rank's slices are ordinary parameters to ZeRO (sharded over the ranks holding
the same slices: the shard group, see [Note: parallel dimensions]). Every check
is agreed on by all ranks before anything changes, so a model the plan cannot
split is the same `ConfigError` on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp.comm.subgroups import GroupComms
from zerodp.config.tensor_parallel import TensorParallelConfig
from zerodp.errors import ConfigError
from zerodp.parallel import TENSOR
from zerodp.tensor_parallel.checks import ReplicaCheck, SameBatchCheck
from zerodp.tensor_parallel.communication import TensorGroup
from zerodp.tensor_parallel.plan import read_plan
from zerodp.tensor_parallel.split import SplitPlan, TensorSplit, plan_split


def split_for_engine(
    module: nn.Module, config: TensorParallelConfig, comms: GroupComms, device: torch.device
) -> TensorSplit | None:
    """Split `module` across this rank's tensor group (None: no tensor parallelism).

    The model must be whole and the same on every rank (the engine takes it from world
    rank 0 first: `zerodp.engine.model_sync`), so that every slice is one of one model.
    """
    dims = comms.dims
    if not dims.splits_tensors:
        return None
    world = comms.world
    error: ConfigError | None = None
    planned: SplitPlan | None = None
    try:
        planned = plan_split(module, read_plan(module, config.plan), dims.tensor_size)
    except ConfigError as caught:
        error = caught
    world.raise_if_any_failed(error)
    if planned is None or comms.tensor is None:  # pragma: no cover - raised above
        raise RuntimeError("internal error: no tensor-parallel plan or group")
    return planned.apply(TensorGroup(comms.tensor, dims.tensor_rank, dims.tensor_size))


class TensorParallelism:
    """The tensor-parallel parts an engine keeps: the split, its checks, its hooks.

    `values` gives the tensors that hold the parameters the plan leaves whole, by
    name (the engine's flat groups; see `ReplicaCheck`).
    """

    def __init__(
        self,
        module: nn.Module,
        split: TensorSplit,
        comms: GroupComms,
        values: Callable[[], list[tuple[str, torch.Tensor]]],
        *,
        verify_each_step: bool,
    ) -> None:
        self.split = split
        tensor_ranks = comms.dims.own_group(TENSOR)
        self.batch_check = SameBatchCheck(split.group, comms.world, tensor_ranks)
        self.replica_check = ReplicaCheck(split.group, comms.world, values)
        self.verify_each_step = verify_each_step
        group = split.group
        self.handles: list[RemovableHandle] = [
            module.register_forward_hook(lambda *_: group.forget(), always_call=True)
        ]

    def on_forward_start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.batch_check.on_forward_start(args, kwargs)

    def after_step(self, step: int) -> None:
        """After an optimizer step: the replica check, when the config asks for it."""
        if self.verify_each_step:
            self.replica_check.check(f"after step {step}")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.split.group.forget()
