"""What a checkpoint saves and restores, handed over by the engine.

The checkpoint code never sees the engine (as in torchtitan, where the
checkpointer knows only `Stateful` pieces): tensors come from the model, the
group records and the torch optimizer; everything else is a piece with
`state_dict()` / `load_state_dict()` and a `check_state_dict()` that raises
`CheckpointError` for a saved value it could not load, so that a load can
check every piece before it changes any.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from zerodp.comm import Comm
from zerodp.group_state import GroupIndex
from zerodp.parallel import ParallelDims
from zerodp.partition import Slicing


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
    # The parallel dimensions (with shard groups that replicate each other, see [Note: shard
    # groups], the first replica writes the shards; each rank reads its own), and with tensor
    # parallelism the parameters that are slices:
    # every name (tied ones too) -> split dim.
    dims: ParallelDims = field(kw_only=True)
    tensor_slices: Mapping[str, int] = field(default_factory=dict)
    # With expert parallelism, every name (tied ones too) of a parameter that is an expert
    # slice (this rank's experts, along dim 0) -> the whole tensor's shape: a checkpoint
    # records whole shapes, so it loads at any E.
    expert_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def expert_slices(self) -> frozenset[str]:
        return frozenset(self.expert_shapes)

    def recorded_shapes(self) -> dict[str, list[int]]:
        """Each parameter's shape as a checkpoint records it: an expert slice's whole shape
        (any E reads the same tensor), a tensor-parallel slice's own (the record of T says
        how many there are)."""
        return {
            name: list(self.expert_shapes.get(name, tuple(p.shape)))
            for name, p in self.module.named_parameters()
        }

    def slicing_of(self, name: str) -> Slicing:
        """Whether the parameter `name` is whole or a tensor or expert slice."""
        if name in self.tensor_slices:
            return Slicing.TENSOR
        if name in self.expert_slices:
            return Slicing.EXPERT
        return Slicing.WHOLE

    @property
    def tensor_size(self) -> int:
        return self.dims.tensor_size

    def places(self, *, saving: bool) -> ShardPlaces:
        """Where the shards a checkpoint tensor describes live (see `ShardPlaces`): a save
        describes the first replica's (each shard written once), a load this rank's own."""
        dims = self.dims
        replica = 0 if saving else dims.replica_index
        groups = tuple(tuple(dims.shard_group_ranks(replica, t)) for t in range(dims.tensor_size))
        experts = None
        if dims.splits_experts:  # expert slices: one of E, each over its expert-data group
            tensor = 0 if saving else dims.tensor_rank
            expert_groups = tuple(
                tuple(dims.expert_data_group_ranks(replica, tensor, e))
                for e in range(dims.expert_size)
            )
            if saving:
                experts = ShardPlaces(expert_groups, whole=0, place=0)
            else:
                experts = ShardPlaces(
                    expert_groups, whole=dims.expert_rank, place=dims.expert_data_rank
                )
        if saving:
            return ShardPlaces(groups, whole=0, place=0, experts=experts)
        return ShardPlaces(groups, whole=dims.tensor_rank, place=dims.shard_rank, experts=experts)


@dataclass(frozen=True)
class ShardPlaces:
    """Which world rank holds each part of a checkpoint tensor, as DCP's metadata says.

    `groups[t]`: the world ranks of the shard group of tensor rank t, in shard order (one
    group without tensor parallelism). A parameter left whole is described by
    `groups[whole]`'s shards. A tensor-parallel slice is saved as part t of a tensor of T
    slices (slice t at offset t x its size), each slice by its own group; a value every
    rank of a shard group holds whole (stage 0, a persistent group) by the rank at
    `place` of each group.
    """

    groups: tuple[tuple[int, ...], ...]
    whole: int = 0
    place: int = 0
    # Expert slices' places (expert parallelism): slice e is EP rank e's experts, sharded
    # over its expert-data group; in a parameter's flattened global tensor, experts first,
    # slice e is at offset e x its size, so another E reads other offsets of the same tensor.
    experts: ShardPlaces | None = None

    @property
    def num_slices(self) -> int:
        return len(self.groups)

    def of(self, slicing: Slicing) -> ShardPlaces:
        """The places of a flat group of kind `slicing`: the experts' for expert slices."""
        if slicing is Slicing.EXPERT:
            if self.experts is None:  # pragma: no cover - experts only with their places
                raise RuntimeError("internal error: expert slices without expert places")
            return self.experts
        return self
