"""Nodes: how many ranks each runs, and which group sizes the nodes can hold (arithmetic only).

[Note: shard groups]
With `mics_shard_size` S (a divisor of the world size N) the ranks form N/S
shard groups of S consecutive ranks: shard group r holds ranks r*S .. r*S+S-1.
Inside a shard group zerodp shards exactly as it shards over all ranks
otherwise: every flat group's layout has S shards, and a rank's shard is the
one at its place in its shard group. The N/S shard groups are replicas of each
other; the ranks at the same place in each of them form a replica group
(ranks i, i+S, i+2S, ...), whose members hold the same shard.

- Parameters are gathered inside the shard group (stage 3: every module's;
  stages 1-2: after a step).
- Gradients are reduce-scattered inside the shard group after every backward,
  and averaged across the replica group once per accumulation boundary (1/S
  of the gradient per rank). Between boundaries each replica keeps the average
  over its own shard group (`GradSync.PARTIAL`), as MiCS and HSDP do, so the
  traffic across shard groups is one all-reduce per step however many
  micro-batches accumulate.
- The replicas of a shard step the same optimizer state with the same averaged
  gradient, so they stay bitwise equal with no parameter traffic between them;
  a gradient norm is summed over the shard group only (a replica group holds
  copies, which must be counted once).

hpZ (`zero_hpz_partition_size` H, stage 3) forms groups of H consecutive
ranks inside each shard group. A gather from the shard group leaves each rank
a secondary shard: the H-th of the full buffer at its place in its hpZ group.
Later gathers of that group all-gather the secondary shards inside the hpZ
group, until the parameters change (see [Note: hpZ secondary shard] in
`zerodp.group_state.secondary`).

Nodes hold consecutive ranks (torchrun's assignment). Ranks per node come from
ZERODP_NODE_SIZE when set (launchers that do not set LOCAL_WORLD_SIZE, and
several simulated nodes on one machine), else torchrun's LOCAL_WORLD_SIZE; a
shard group must lie inside one node or span whole nodes, an hpZ group must lie
inside one node. `zerodp.comm.subgroups` checks that against the hosts the
ranks run on and builds the process groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from zerodp.errors import ConfigError

NODE_SIZE_ENV = "ZERODP_NODE_SIZE"
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"


@dataclass(frozen=True)
class NodeSize:
    """Ranks per node and where that number came from (named in errors)."""

    ranks: int
    source: str  # "ZERODP_NODE_SIZE", "LOCAL_WORLD_SIZE", or "one node per host"


def node_size_from_env(environ: dict[str, str] | None = None) -> NodeSize | None:
    """ZERODP_NODE_SIZE, else LOCAL_WORLD_SIZE; None when neither is set.

    A value that is not a positive integer is a `ConfigError` naming the variable.
    """
    env = os.environ if environ is None else environ
    for name in (NODE_SIZE_ENV, LOCAL_WORLD_SIZE_ENV):
        text = env.get(name, "").strip()
        if not text:
            continue
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(
                f"{name}={text!r}: expected the number of ranks on each node (an integer >= 1)"
            )
        return NodeSize(int(text), name)
    return None


def check_sizes(world_size: int, node: NodeSize, shard_size: int, secondary_size: int) -> list[str]:
    """What the nodes cannot hold (each message names the fix); empty when they fit.

    `shard_size` is the world size when sharding over all ranks. Whether the sizes divide
    the world at all is `zerodp.parallel.size_problems`'s to say, checked first. Pure:
    every rank computes the same messages from the same numbers.
    """
    problems = []
    nodes = node.ranks
    if world_size % nodes != 0:
        problems.append(
            f"{node.source}={nodes} does not divide the world size {world_size}: every node "
            f"must run the same number of ranks (torchrun --nproc_per_node), or set "
            f"{NODE_SIZE_ENV} to the ranks per node"
        )
        return problems
    if world_size % shard_size == 0 and shard_size % nodes != 0 and nodes % shard_size != 0:
        first = next(
            start
            for start in range(0, world_size, shard_size)
            if start // nodes != (start + shard_size - 1) // nodes
        )
        last = first + shard_size - 1
        problems.append(
            f"zero_optimization.mics_shard_size {shard_size} puts the ranks of one shard group "
            f"({first}..{last}) on nodes {first // nodes} and {last // nodes} ({nodes} ranks "
            f"per node, from {node.source}), so its gathers cross nodes for part of the group "
            f"only: set it to a divisor of {nodes} (shard groups inside a node) or a multiple "
            f"of {nodes} (whole nodes)"
        )
    if secondary_size > 1:
        if nodes % secondary_size != 0:
            problems.append(
                f"zero_optimization.zero_hpz_partition_size {secondary_size} makes hpZ groups "
                f"that span nodes ({nodes} ranks per node, from {node.source}); the secondary "
                f"copy is there to keep backward gathers inside a node: set it to {nodes} or "
                "a divisor of it"
            )
        elif world_size % shard_size == 0 and shard_size % secondary_size != 0:
            problems.append(
                f"zero_optimization.zero_hpz_partition_size {secondary_size} does not divide "
                f"the shard group's size {shard_size}; hpZ groups lie inside a shard group: "
                f"set it to a divisor of {shard_size}"
            )
    return problems


@dataclass(frozen=True)
class RankView:
    """What one rank knows about its node: the size its environment gives (or the error
    reading it), its host, its LOCAL_RANK."""

    node_size: NodeSize | str | None
    host: str
    local_rank: str | None


def nodes_from_views(views: list[RankView]) -> NodeSize:
    """The ranks per node all ranks agree on, checked against the hosts they run on.

    Pure: every rank computes the same answer (or the same `ConfigError`) from every
    rank's view. Without ZERODP_NODE_SIZE and LOCAL_WORLD_SIZE, consecutive ranks on one
    host make a node.
    """
    for rank, view in enumerate(views):
        if isinstance(view.node_size, str):
            raise ConfigError(f"rank {rank}: {view.node_size}")
    sizes = {view.node_size for view in views}
    if len(sizes) > 1:
        shown = ", ".join(
            f"rank {r}: "
            + ("unset" if not isinstance(v.node_size, NodeSize) else _shown(v.node_size))
            for r, v in enumerate(views)
        )
        raise ConfigError(
            f"the ranks disagree on the ranks per node ({shown}): run the same number of "
            f"processes on every node, or set {NODE_SIZE_ENV} alike on every rank"
        )
    hosts = [view.host for view in views]
    node = next(iter(sizes))
    if not isinstance(node, NodeSize):
        node = _node_size_from_hosts(hosts)
    world_size = len(views)
    if world_size % node.ranks != 0:
        return node  # check_sizes names the fix
    for start in range(0, world_size, node.ranks):
        block = hosts[start : start + node.ranks]
        if len(set(block)) > 1:
            raise ConfigError(
                f"ranks {start}..{start + node.ranks - 1} make one node by {_shown(node)}, but "
                f"they run on hosts {sorted(set(block))}: set {NODE_SIZE_ENV} to the number of "
                "ranks on each host (nodes hold consecutive ranks, as torchrun assigns them)"
            )
    if node.source == LOCAL_WORLD_SIZE_ENV:
        for rank, view in enumerate(views):
            local = view.local_rank
            if local is not None and local.isdigit() and int(local) != rank % node.ranks:
                raise ConfigError(
                    f"rank {rank} has LOCAL_RANK {local}, but with {node.ranks} ranks per node "
                    f"it would be {rank % node.ranks}: nodes must hold consecutive ranks (as "
                    f"torchrun assigns them); launch with torchrun, or set {NODE_SIZE_ENV}"
                )
    return node


def _shown(node: NodeSize) -> str:
    return f"{node.source}={node.ranks}"


def _node_size_from_hosts(hosts: list[str]) -> NodeSize:
    """Consecutive ranks on one host make a node; every node must hold as many."""
    runs: list[int] = []
    for index, host in enumerate(hosts):
        if index == 0 or host != hosts[index - 1]:
            runs.append(0)
        runs[-1] += 1
    if len(set(runs)) != 1 or len(runs) != len(set(hosts)):
        raise ConfigError(
            f"cannot tell the ranks per node: {LOCAL_WORLD_SIZE_ENV} is not set and the hosts "
            f"do not hold equal runs of consecutive ranks ({len(set(hosts))} hosts, runs of "
            f"{runs}); launch with torchrun, or set {NODE_SIZE_ENV}"
        )
    return NodeSize(runs[0], "one node per host")
