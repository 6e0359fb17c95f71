"""What a checkpoint saves and restores, handed over by the engine.

The checkpoint code never sees the engine (as in torchtitan, where the
checkpointer knows only `Stateful` pieces): tensors come from the model, the
group records and the torch optimizer; everything else is a piece with
`state_dict()` / `load_state_dict()` and a `check_state_dict()` that raises
`CheckpointError` for a saved value it could not load, so that a load can
check every piece before it changes any.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from zerodp.comm import Comm
from zerodp.group import GroupIndex


class Stateful(Protocol):
    """A piece of training state saved as JSON."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class WholeTensorState(Protocol):
    """The parameters an optimizer steps whole (see `zerodp.optim.tensorwise`): their optimizer
    state is held, whole and in its own shape, by the rank that steps each one."""

    names: set[str]  # every parameter stepped whole, by name

    def owned_params(self) -> dict[str, nn.Parameter]:
        """The whole-tensor optimizer parameters this rank steps, by model parameter name."""
        ...


class CheckedStateful(Stateful, Protocol):
    """A JSON piece that can say, before anything is loaded, whether a saved state fits it."""

    def check_state_dict(self, state: Any) -> None: ...


@dataclass(frozen=True)
class CheckpointSubject:
    """The engine's state as a checkpoint sees it.

    `check_idle` raises when a checkpoint cannot be taken now (inside a
    backward); `after_load` makes the model's parameters follow the owned
    ranges just loaded and zeroes the gradients. The kept gradients
    themselves are in the group records; `gradients_held` says whether they
    hold anything (a window's accumulation, saved with the checkpoint; it
    raises when a backward left them incomplete), `gradients_loaded` is
    called once a load has filled them, and `local_accumulation` says
    whether this stage keeps local sums inside a window (stages 0 and 1).
    """

    comm: Comm
    module: nn.Module
    groups: GroupIndex
    optimizer: torch.optim.Optimizer  # the torch optimizer: its per-parameter state
    zero_stage: int
    param_dtype: torch.dtype
    counters: CheckedStateful
    optimizer_settings: CheckedStateful
    loss_scaler: CheckedStateful
    lr_scheduler: Stateful | None
    dataloader: Stateful | None
    check_idle: Callable[[], None]
    after_load: Callable[[], None]
    accumulation_steps: int = 1
    local_accumulation: bool = False
    loss_scale: Callable[[], float] = lambda: 1.0
    gradients_held: Callable[[], bool] = lambda: False
    gradients_loaded: Callable[[], None] = lambda: None
    # Values written by `param.data = t` since the last step go into the groups first, so
    # that the save holds what the model shows (see `FlatGroup.adopt_replaced`).
    before_save: Callable[[], None] = lambda: None
    whole_tensors: WholeTensorState | None = None  # None: every optimizer steps flat shards
    # Shard groups that replicate each other (see [Note: shard groups]): how many, and
    # which one this rank is in. The first writes the shards; each rank reads its own.
    num_replicas: int = 1
    replica_index: int = 0

    @property
    def shard_group_first_rank(self) -> int:
        """The first rank of this rank's shard group (where its loads' shards lie)."""
        return self.replica_index * (self.comm.world_size // self.num_replicas)
