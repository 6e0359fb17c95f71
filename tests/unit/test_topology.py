"""Shard groups, replica groups and hpZ groups as arithmetic, and every size the nodes refuse.

The process-group side (the groups built, the same error on every rank) runs on 4 processes
in tests/distributed/test_hybrid.py; here each rule is checked with worlds too large to start.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from zerodp.comm.topology import (
    NodeSize,
    RankView,
    check_sizes,
    node_size_from_env,
    nodes_from_views,
)
from zerodp.config import load_config
from zerodp.errors import ConfigError
from zerodp.parallel import ParallelDims

LOCAL = NodeSize(8, "LOCAL_WORLD_SIZE")


def test_groups_of_two_nodes_of_four_with_shard_groups_of_two() -> None:
    dims = ParallelDims.build(8, 5, shard_group_size=2)
    assert dims.shard_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.replica_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert (dims.shard_rank, dims.replica_index, dims.num_replicas) == (1, 2, 4)
    assert dims.own_group("shard") == [4, 5]
    assert dims.own_group("replica") == [1, 3, 5, 7]
    assert not _crosses_nodes(dims, "shard", 4)
    assert _crosses_nodes(dims, "replica", 4) and _crosses_nodes(dims, "world", 4)
    assert dims.hybrid and not dims.keeps_secondary


def _crosses_nodes(dims: ParallelDims, label: str, node_size: int) -> bool:
    return len({r // node_size for r in dims.own_group(label)}) > 1


def test_hpz_groups_lie_inside_the_shard_group() -> None:
    flat = ParallelDims.build(16, 9, shard_group_size=16, secondary_size=8)
    assert flat.keeps_secondary and not flat.hybrid
    assert flat.own_group("secondary") == list(range(8, 16))
    assert not _crosses_nodes(flat, "secondary", 8) and _crosses_nodes(flat, "shard", 8)
    same = ParallelDims.build(16, 9, shard_group_size=8, secondary_size=8)
    assert not same.keeps_secondary  # the shard group is that small already


@pytest.mark.parametrize(
    ("world", "node", "shard", "hpz"),
    [(16, 8, 8, 1), (16, 8, 4, 1), (32, 8, 16, 1), (16, 8, 16, 8), (16, 8, 8, 4), (8, 8, 2, 2)],
)
def test_sizes_that_fit(world: int, node: int, shard: int, hpz: int) -> None:
    assert check_sizes(world, NodeSize(node, "LOCAL_WORLD_SIZE"), shard, hpz) == []


@pytest.mark.parametrize(
    ("world", "node", "shard", "hpz", "expected"),
    [
        (24, 8, 12, 1, "shard group (0..11) on nodes 0 and 1 (8 ranks per node"),
        (24, 8, 12, 1, "set it to a divisor of 8 (shard groups inside a node) or a multiple of 8"),
        (16, 8, 16, 16, "zero_hpz_partition_size 16 makes hpZ groups that span nodes"),
        (16, 8, 16, 3, "zero_hpz_partition_size 3 makes hpZ groups that span nodes"),
        (16, 8, 2, 4, "zero_hpz_partition_size 4 does not divide the shard group's size 2"),
        (12, 8, 4, 1, "LOCAL_WORLD_SIZE=8 does not divide the world size 12"),
    ],
)
def test_sizes_the_nodes_refuse_name_the_fix(
    world: int, node: int, shard: int, hpz: int, expected: str
) -> None:
    problems = " ".join(check_sizes(world, NodeSize(node, "LOCAL_WORLD_SIZE"), shard, hpz))
    assert expected in problems


def test_node_size_from_the_environment() -> None:
    assert node_size_from_env({"LOCAL_WORLD_SIZE": "8"}) == NodeSize(8, "LOCAL_WORLD_SIZE")
    both = {"LOCAL_WORLD_SIZE": "8", "ZERODP_NODE_SIZE": "2"}
    assert node_size_from_env(both) == NodeSize(2, "ZERODP_NODE_SIZE")  # simulated nodes
    assert node_size_from_env({}) is None
    with pytest.raises(ConfigError, match="ZERODP_NODE_SIZE='two': expected the number"):
        node_size_from_env({"ZERODP_NODE_SIZE": "two"})


def views(hosts: list[str], node: NodeSize | str | None = LOCAL, local: bool = True) -> Any:
    size = node.ranks if isinstance(node, NodeSize) else len(hosts)
    return [
        RankView(node, host, str(rank % size) if local else None) for rank, host in enumerate(hosts)
    ]


def test_nodes_agreed_from_the_hosts() -> None:
    two_hosts = ["a"] * 8 + ["b"] * 8
    assert nodes_from_views(views(two_hosts)) == LOCAL
    inferred = nodes_from_views(views(two_hosts, node=None, local=False))
    assert inferred == NodeSize(8, "one node per host")


def test_nodes_that_do_not_match_the_hosts_name_the_fix() -> None:
    with pytest.raises(ConfigError, match=re.escape("ranks 0..7 make one node by LOCAL_WORLD")):
        nodes_from_views(views(["a"] * 4 + ["b"] * 12))
    with pytest.raises(ConfigError, match="hosts do not hold equal runs of consecutive ranks"):
        nodes_from_views(views(["a"] * 4 + ["b"] * 12, node=None))
    interleaved = views(["a", "b"] * 8, node=None)
    with pytest.raises(ConfigError, match="set ZERODP_NODE_SIZE"):
        nodes_from_views(interleaved)
    mixed = views(["a"] * 16)
    mixed[3] = RankView(NodeSize(4, "ZERODP_NODE_SIZE"), "a", "3")
    with pytest.raises(ConfigError, match="the ranks disagree on the ranks per node"):
        nodes_from_views(mixed)
    shuffled = views(["a"] * 8 + ["b"] * 8)
    shuffled[9] = RankView(LOCAL, "b", "4")
    with pytest.raises(ConfigError, match="rank 9 has LOCAL_RANK 4, but with 8 ranks per node"):
        nodes_from_views(shuffled)
    broken = views(["a"] * 16)
    broken[2] = RankView("LOCAL_WORLD_SIZE='x': expected", "a", "2")
    with pytest.raises(ConfigError, match="rank 2: LOCAL_WORLD_SIZE='x'"):
        nodes_from_views(broken)


def load(stage: int, **zero: Any) -> Any:
    config = {"train_batch_size": 16, "zero_optimization": {"stage": stage, **zero}}
    return load_config(config, world_size=16)


@pytest.mark.parametrize(
    ("stage", "zero", "expected"),
    [
        (0, {"mics_shard_size": 8}, "at stage 0, which shards nothing"),
        (3, {"mics_shard_size": 0}, "allowed: -1 (shard over all ranks)"),
        (2, {"zero_hpz_partition_size": 8}, "hpZ keeps a secondary copy of stage 3's"),
        (3, {"zero_hpz_partition_size": 4, "mics_shard_size": 6}, "does not divide"),
        (
            3,
            {"zero_hpz_partition_size": 8, "offload_param": {"device": "cpu"}},
            "parameter offload moves off it",
        ),
    ],
)
def test_config_refuses_groups_the_stage_cannot_use(
    stage: int, zero: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load(stage, **zero)


def test_config_accepts_shard_groups_at_stages_1_to_3() -> None:
    for stage in (1, 2, 3):
        assert load(stage, mics_shard_size=8).zero_optimization.mics_shard_size == 8
    zero = load(3, mics_shard_size=8, zero_hpz_partition_size=4).zero_optimization
    assert zero.zero_hpz_partition_size == 4
