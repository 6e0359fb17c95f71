"""The process groups of several nodes: shard, replica and hpZ groups, checked and built once.

See [Note: shard groups] in `zerodp.comm.topology` for what each group does.
`group_comms` checks the sizes against the nodes the ranks really run on (one
small collective: every rank's host, LOCAL_RANK and node size) and raises the
same `ConfigError` on every rank when a group would span nodes by accident;
then it builds the groups. torch's `new_group` is a collective over all ranks,
so the groups are made once per process group and reused by every engine and
`zero.Init` that asks for the same sizes. Each group's `Comm` counts into the
engine's stats under its label ("shard", "replica", "secondary"), and
`GroupComms.traffic` splits those bytes into within a node and across nodes.
Every group is destroyed with the rest at exit (`dist.destroy_process_group()`
destroys all of them; see [Note: ending the process]).
"""

from __future__ import annotations

import datetime
import os
import socket
import warnings
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from zerodp.comm.collectives import WORLD, Comm
from zerodp.comm.topology import (
    NodeSize,
    RankView,
    check_sizes,
    node_size_from_env,
    nodes_from_views,
)
from zerodp.errors import ConfigError, ConfigWarning
from zerodp.parallel import (
    EXPERT,
    EXPERT_DATA,
    LABELS,
    REPLICA,
    SECONDARY,
    SEQUENCE,
    SHARD,
    SLICE,
    TENSOR,
    ParallelDims,
)

WITHIN_NODE = "within a node"
ACROSS_NODES = "across nodes"


@dataclass(frozen=True)
class GroupComms:
    """The `Comm` of each group this rank is in, and the dims they were built from.

    `shard` is where parameters are gathered and gradients reduce-scattered (the world
    `Comm` itself when sharding over all ranks); `replica` averages gradients across
    shard groups at the accumulation boundary (None without replicas); `secondary` is
    hpZ's group, `sequence` and `tensor` the sequence- and tensor-parallel groups (None
    where that dimension has one rank), `slice` the ranks holding the same parameter
    values when tensors are split (None otherwise), `expert` the EP group that exchanges
    tokens and `expert_data` the ranks holding the same experts, which shard them (None
    without expert parallelism). What each group's reductions are divided by, and which
    groups a norm is summed over, is for `dims` to say (see [Note: parallel dimensions] in
    `zerodp.parallel.dims`).
    """

    dims: ParallelDims
    node_size: int
    world: Comm
    shard: Comm
    replica: Comm | None = None
    secondary: Comm | None = None
    sequence: Comm | None = None
    tensor: Comm | None = None
    slice: Comm | None = None
    expert: Comm | None = None
    expert_data: Comm | None = None

    @property
    def subgroups(self) -> list[Comm]:
        """The `Comm`s over groups other than the default one."""
        found = [
            self.shard,
            self.replica,
            self.secondary,
            self.sequence,
            self.tensor,
            self.slice,
            self.expert,
            self.expert_data,
        ]
        return [c for c in found if c is not None and c is not self.world]

    def of(self, label: str) -> Comm | None:
        """The `Comm` of this rank's group of kind `label` (None: a group of one rank);
        an unknown label is a `ValueError`, never the world."""
        comms = {
            WORLD: self.world,
            SHARD: self.shard,
            REPLICA: self.replica,
            SECONDARY: self.secondary,
            SEQUENCE: self.sequence,
            TENSOR: self.tensor,
            SLICE: self.slice,
            EXPERT: self.expert,
            EXPERT_DATA: self.expert_data,
        }
        if label not in comms:
            raise ValueError(f"no kind of group is called {label!r}")
        return comms[label]

    def shard_of(self, flat: Any) -> Comm:
        """The group a flat group is sharded over, its gradients reduced in and its stage 3
        gathers issued in: the shard group, or for expert slices (`flat.expert`) the
        expert-data group (the ranks holding the same experts)."""
        if getattr(flat, "expert", False):
            if self.expert_data is None:  # pragma: no cover - experts only with their group
                raise RuntimeError("internal error: expert slices without an expert-data group")
            return self.expert_data
        return self.shard

    def crosses_nodes(self, label: str) -> bool:
        """Whether this rank's group of kind `label` has ranks on more than one node."""
        return len({r // self.node_size for r in self.dims.own_group(label)}) > 1

    def traffic(self) -> dict[str, int]:
        """This rank's bytes since the stats' last reset, by group label and by reach."""
        stats = self.world.stats
        out: dict[str, int] = {}
        for label in (WORLD, *LABELS):
            nbytes = stats.bytes_of_group(label)
            if nbytes:
                out[label] = nbytes
                reach = ACROSS_NODES if self.crosses_nodes(label) else WITHIN_NODE
                out[reach] = out.get(reach, 0) + nbytes
        return out

    def agreement_traffic(self) -> dict[str, int]:
        """The uneven-inputs agreements' bytes since the stats' last reset, by reach (kept
        apart from `traffic()`, the work's own)."""
        out: dict[str, int] = {}
        for label, nbytes in self.world.stats.agreements.items():
            reach = ACROSS_NODES if self.crosses_nodes(label) else WITHIN_NODE
            out[reach] = out.get(reach, 0) + nbytes
        return out

    def inside_shard_group(self) -> frozenset[str]:
        """The labels of this rank's groups that lie inside its shard group."""
        shard = set(self.dims.own_group(SHARD))
        return frozenset(
            label
            for label in (SHARD, *LABELS)
            if self.of(label) is not None and set(self.dims.own_group(label)) <= shard
        )


def flat_comms(world: Comm) -> GroupComms:
    """Sharding over all ranks: the world is the shard group."""
    node_size = world.world_size
    try:
        node = node_size_from_env()
    except ConfigError:
        node = None  # only used to label traffic; a flat run does not depend on it
    if node is not None and node.ranks <= world.world_size and world.world_size % node.ranks == 0:
        node_size = node.ranks
    dims = ParallelDims.build(world.world_size, world.rank)
    return GroupComms(dims, node_size, world, world)


def group_comms(
    world: Comm,
    *,
    shard_size: int = -1,
    secondary_size: int = 1,
    sequence_size: int = 1,
    tensor_size: int = 1,
    expert_size: int = 1,
    timeout: datetime.timedelta | None = None,
) -> GroupComms:
    """The groups for `mics_shard_size` (-1: all ranks), `zero_hpz_partition_size`, and
    the sequence- and tensor-parallel sizes.

    A collective: every rank calls it with the same sizes (the config, checked alike at
    start-up). Raises `ConfigError` on every rank for sizes the nodes cannot hold.
    `timeout` bounds the new groups' collectives (the config's comms_timeout_s).
    """
    world_size = world.world_size
    error: ConfigError | None = None
    dims: ParallelDims | None = None
    node_size = world_size
    try:  # pure arithmetic: every rank raises alike, before any collective
        dims = ParallelDims.build(
            world_size,
            world.rank,
            shard_group_size=shard_size,
            secondary_size=secondary_size,
            sequence_size=sequence_size,
            tensor_size=tensor_size,
            expert_size=expert_size,
        )
    except ConfigError as caught:
        error = caught
    if dims is not None and dims.is_flat:
        return flat_comms(world)
    if dims is not None:
        try:
            node = _agreed_node_size(world)
            problems = check_sizes(world_size, node, dims.shard_span, secondary_size)
            if problems:
                raise ConfigError("; ".join(problems))
            node_size = node.ranks
        except ConfigError as caught:
            error = caught
    world.raise_if_any_failed(error)
    if dims is None:  # pragma: no cover - raised above on every rank
        raise RuntimeError("internal error: no parallel dims")
    _warn_without_effect(dims)
    made: dict[str, Comm] = {}
    for label in LABELS:
        if dims.needs_group(label):
            made[label] = Comm(_own_group(dims, label, timeout), label=label, parent=world)
        elif label != SECONDARY and dims.group_size(label) == world_size > 1:
            made[label] = world  # the group is every rank (tensor parallelism over all of them)
    return GroupComms(
        dims,
        node_size,
        world,
        made.get(SHARD, world),
        replica=made.get(REPLICA),
        secondary=made.get(SECONDARY),
        sequence=made.get(SEQUENCE),
        tensor=made.get(TENSOR),
        slice=made.get(SLICE),
        expert=made.get(EXPERT),
        expert_data=made.get(EXPERT_DATA),
    )


def _warn_without_effect(dims: ParallelDims) -> None:
    if dims.rank == 0 and dims.secondary_size > 1 and not dims.keeps_secondary:
        warnings.warn(
            f"zero_optimization.zero_hpz_partition_size {dims.secondary_size} has no effect: "
            f"the shard group has {dims.shard_group_size} ranks already, so every gather stays "
            "inside a group that size; no secondary copy is kept",
            ConfigWarning,
            stacklevel=3,
        )


# -- the nodes -----------------------------------------------------------------------------


def _agreed_node_size(world: Comm) -> NodeSize:
    """Ranks per node, the same on every rank, checked against the hosts ranks run on."""
    try:
        mine: NodeSize | str | None = node_size_from_env()
    except ConfigError as error:
        mine = str(error)
    view = RankView(mine, socket.gethostname(), os.environ.get("LOCAL_RANK"))
    return nodes_from_views(world.all_gather_object(view))


# -- process groups, made once -------------------------------------------------------------

_MADE: dict[tuple[str, tuple[tuple[int, ...], ...]], Any] = {}
_MADE_FOR: list[Any] = []  # the default group the groups in _MADE belong to


def _own_group(dims: ParallelDims, label: str, timeout: datetime.timedelta | None) -> Any:
    """This rank's process group of kind `label`, made (a collective) the first time."""
    world_group = dist.group.WORLD
    if not _MADE_FOR or _MADE_FOR[0] is not world_group:
        _MADE.clear()
        _MADE_FOR[:] = [world_group]
    enumeration = tuple(tuple(group) for group in dims.groups_of(label))
    key = (label, enumeration)
    if key not in _MADE:
        _MADE[key] = dist.new_subgroups_by_enumeration(
            [list(g) for g in enumeration], timeout=timeout, group_desc=f"zerodp {label}"
        )[0]
    return _MADE[key]
