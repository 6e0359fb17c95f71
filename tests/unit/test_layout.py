"""Flat-buffer arithmetic and grouping plans: pure functions, checked against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from zerodp.partition import FlatLayout
from zerodp.partition.planner import ParamInfo, plan_buckets, plan_stage3


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize(
    "shapes", [[(7, 11), (11,), (11,), (11, 5), (5,)], [(1,)], [(3,), (2, 2)], [(10,)] * 3]
)
def test_shards_cover_every_element_exactly_once(shapes, world_size) -> None:
    layout = FlatLayout.build(shapes, world_size)
    total = sum(math.prod(s) for s in shapes)
    assert layout.numel == total
    assert layout.padded_numel % world_size == 0
    assert 0 <= layout.padding < world_size
    owners = [0] * total
    for slot_index, slot in enumerate(layout.slots):
        for rank in range(world_size):
            overlap = layout.overlap(slot_index, rank)
            if overlap is None:
                continue
            start, _ = layout.shard_range(rank)
            assert overlap.shard_end - overlap.shard_start == overlap.numel
            for k in range(overlap.param_start, overlap.param_end):
                element = slot.offset + k
                assert start + overlap.shard_start + (k - overlap.param_start) == element
                owners[element] += 1
    assert owners == [1] * total


def test_shard_ranges_are_contiguous_and_equal() -> None:
    layout = FlatLayout.build([(5,), (4,)], 4)
    ranges = [layout.shard_range(r) for r in range(4)]
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError, match="outside world size"):
        layout.shard_range(4)


def _infos(sizes, groups=None, owners=None):
    return [
        ParamInfo(
            index=i,
            name=f"p{i}",
            numel=n,
            dtype=torch.float32,
            param_group=(groups or [0] * len(sizes))[i],
            trainable=True,
            owner=(owners or list(range(len(sizes))))[i],
        )
        for i, n in enumerate(sizes)
    ]


def test_buckets_respect_size_and_param_group_and_reverse_order() -> None:
    infos = _infos([10, 10, 10, 10, 10], groups=[0, 1, 0, 1, 0])
    plans = plan_buckets(infos, bucket_numel=20, persistent=True)
    for plan in plans:
        assert len({infos[i].param_group for i in plan.members}) == 1
        assert sum(infos[i].numel for i in plan.members) <= 20
    assert sorted(itertools.chain.from_iterable(p.members for p in plans)) == [0, 1, 2, 3, 4]
    first = [min(p.members) for p in plans]  # each group complete at its first member
    assert first == sorted(first, reverse=True), "reduction order is reverse registration order"


def test_stage3_groups_large_params_by_module_and_buckets_small_ones() -> None:
    infos = _infos([100, 5, 100, 5, 100], owners=[0, 0, 1, 1, 2])
    plans = plan_stage3(infos, persistence_threshold=10, bucket_numel=1000)
    large = [p for p in plans if not p.persistent]
    small = [p for p in plans if p.persistent]
    assert sorted(p.members for p in large) == [(0,), (2,), (4,)]
    assert sorted(itertools.chain.from_iterable(p.members for p in small)) == [1, 3]
    # Reduced when complete: the small parameters' group (members 3 and 1) once parameter 1,
    # the earliest, has its gradient, so after parameter 2's group and before parameter 0's.
    assert [p.members for p in plans] == [(4,), (2,), (3, 1), (0,)]


def _block() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))


def test_units_are_the_outermost_small_modules_that_run_a_forward() -> None:
    from zerodp.partition.builder import plan_units

    root = torch.nn.Module()
    root.blocks = torch.nn.ModuleList([_block(), _block()])  # a container never runs forward
    root.big = torch.nn.Linear(8, 8)  # 72 elements: over the limit, not a unit
    root.leafy = _block()
    block_numel = sum(p.numel() for p in root.blocks[0].parameters())
    unit_of = plan_units(root, block_numel, excluded={root.leafy[1]})
    for block in root.blocks:
        assert all(unit_of[m] is block for m in block.modules())
    assert root.blocks not in unit_of and root not in unit_of and root.big not in unit_of
    # A module holding an excluded one (a leaf) is not a unit; its other children may be.
    assert root.leafy not in unit_of and root.leafy[1] not in unit_of
    assert unit_of[root.leafy[0]] is root.leafy[0]
    assert plan_units(root, 0) == {}
    assert plan_units(root, 10**9)[root.big] is root.big  # the root itself never is one


def test_block_units_are_the_repeated_blocks_within_the_bound() -> None:
    from zerodp.partition.blocks import plan_block_units

    root = torch.nn.Module()
    root.embed = torch.nn.Linear(4, 4)  # outside every block: never a unit here
    root.blocks = torch.nn.ModuleList([_block(), _block(), _block()])
    root.mixed = torch.nn.Sequential(_block(), torch.nn.Linear(4, 4))  # two classes: no blocks
    block_numel = sum(p.numel() for p in root.blocks[0].parameters())
    unit_of = plan_block_units(root, block_numel, excluded={root.blocks[2][1]})
    for block in root.blocks[:2]:
        assert all(unit_of[m] is block for m in block.modules())
    # A block holding an excluded module (a leaf) is not a unit, nor is anything in it.
    assert not any(m in unit_of for m in root.blocks[2].modules())
    assert not any(m in unit_of for m in (root, root.embed, root.blocks, *root.mixed.modules()))
    # Over the bound: no unit; the root is never one, even when it is a stack of blocks.
    assert plan_block_units(root, block_numel - 1) == {}
    stack = torch.nn.Sequential(_block(), _block())
    assert set(plan_block_units(stack, 10**9).values()) == set(stack.children())
