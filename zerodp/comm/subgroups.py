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
    REPLICA,
    SECONDARY,
    SHARD,
    NodeSize,
    RankView,
    Topology,
    check_sizes,
    node_size_from_env,
    nodes_from_views,
)
from zerodp.errors import ConfigError, ConfigWarning

WITHIN_NODE = "within a node"
ACROSS_NODES = "across nodes"


@dataclass(frozen=True)
class GroupComms:
    """The `Comm` of each group this rank is in.

    `shard` is where parameters are gathered and gradients reduce-scattered (the world
    `Comm` itself when sharding over all ranks); `replica` averages gradients across
    shard groups at the accumulation boundary (None without replicas); `secondary` is
    hpZ's group (None without a secondary shard).
    """

    topology: Topology
    world: Comm
    shard: Comm
    replica: Comm | None = None
    secondary: Comm | None = None

    @property
    def subgroups(self) -> list[Comm]:
        """The `Comm`s over groups other than the default one."""
        found = [self.shard, self.replica, self.secondary]
        return [c for c in found if c is not None and c is not self.world]

    def crosses_nodes(self, label: str) -> bool:
        return self.topology.crosses_nodes(label)

    def traffic(self) -> dict[str, int]:
        """This rank's bytes since the stats' last reset, by group label and by reach."""
        stats = self.world.stats
        out: dict[str, int] = {}
        for label in (WORLD, SHARD, REPLICA, SECONDARY):
            nbytes = stats.bytes_of_group(label)
            if nbytes:
                out[label] = nbytes
                reach = ACROSS_NODES if self.crosses_nodes(label) else WITHIN_NODE
                out[reach] = out.get(reach, 0) + nbytes
        return out


def flat_comms(world: Comm) -> GroupComms:
    """Sharding over all ranks: the world is the shard group."""
    node_size = world.world_size
    try:
        node = node_size_from_env()
    except ConfigError:
        node = None  # only used to label traffic; a flat run does not depend on it
    if node is not None and node.ranks <= world.world_size and world.world_size % node.ranks == 0:
        node_size = node.ranks
    topology = Topology(world.world_size, world.rank, node_size, world.world_size)
    return GroupComms(topology, world, world)


def group_comms(
    world: Comm,
    *,
    shard_size: int = -1,
    secondary_size: int = 1,
    timeout: datetime.timedelta | None = None,
) -> GroupComms:
    """The groups for `mics_shard_size` (-1: all ranks) and `zero_hpz_partition_size`.

    A collective: every rank calls it with the same sizes (the config, checked alike at
    start-up). Raises `ConfigError` on every rank for sizes the nodes cannot hold.
    `timeout` bounds the new groups' collectives (the config's comms_timeout_s).
    """
    world_size = world.world_size
    shard = world_size if shard_size <= 0 else shard_size
    if shard == world_size and secondary_size <= 1:
        return flat_comms(world)
    error: ConfigError | None = None
    topology: Topology | None = None
    try:
        node = _agreed_node_size(world)
        problems = check_sizes(world_size, node, shard, secondary_size)
        if problems:
            raise ConfigError("; ".join(problems))
        topology = Topology(world_size, world.rank, node.ranks, shard, secondary_size)
    except ConfigError as caught:
        error = caught
    world.raise_if_any_failed(error)
    if topology is None:  # pragma: no cover - raised above on every rank
        raise RuntimeError("internal error: no topology")
    _warn_without_effect(topology)
    replica = secondary = None
    shard_comm = world
    if topology.shard_size < world_size:
        shard_comm = Comm(_own_group(topology, SHARD, timeout), label=SHARD, parent=world)
    if topology.hybrid:
        replica = Comm(_own_group(topology, REPLICA, timeout), label=REPLICA, parent=world)
    if topology.keeps_secondary:
        group = _own_group(topology, SECONDARY, timeout)
        secondary = Comm(group, label=SECONDARY, parent=world)
    return GroupComms(topology, world, shard_comm, replica, secondary)


def _warn_without_effect(topology: Topology) -> None:
    if topology.rank == 0 and topology.secondary_size > 1 and not topology.keeps_secondary:
        warnings.warn(
            f"zero_optimization.zero_hpz_partition_size {topology.secondary_size} has no effect: "
            f"the shard group has {topology.shard_size} ranks already, so every gather stays "
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


def _own_group(topology: Topology, label: str, timeout: datetime.timedelta | None) -> Any:
    """This rank's process group of kind `label`, made (a collective) the first time."""
    world_group = dist.group.WORLD
    if not _MADE_FOR or _MADE_FOR[0] is not world_group:
        _MADE.clear()
        _MADE_FOR[:] = [world_group]
    enumeration = tuple(tuple(group) for group in topology.groups_of(label))
    key = (label, enumeration)
    if key not in _MADE:
        _MADE[key] = dist.new_subgroups_by_enumeration(
            [list(g) for g in enumeration], timeout=timeout, group_desc=f"zerodp {label}"
        )[0]
    return _MADE[key]
