"""The parallel dimensions as arithmetic: every group a partition of the ranks, coordinates that
name each rank once, and the reduction, norm and data rules, checked against the mesh's
definition (rank = ((r * Z + z) * S + s) * T + t) written out independently here.
"""

from __future__ import annotations

import itertools

import pytest

from zerodp.errors import ConfigError
from zerodp.parallel import (
    EXPERT,
    EXPERT_DATA,
    REPLICA,
    SECONDARY,
    SEQUENCE,
    SHARD,
    SLICE,
    TENSOR,
    WORLD,
    ParallelDims,
    data_parallel_size,
)

# (world, mics shard size or -1, sequence, tensor, hpZ)
MESHES = [
    (8, -1, 1, 1, 1),
    (8, 2, 1, 1, 1),
    (16, -1, 1, 1, 8),
    (8, -1, 2, 1, 1),
    (8, 4, 2, 1, 1),
    (8, -1, 1, 2, 1),
    (16, 4, 2, 2, 1),
    (24, -1, 3, 2, 1),
    (16, 8, 2, 1, 2),
]


def _coordinates(dims: ParallelDims, rank: int) -> tuple[int, int, int, int]:
    """(r, z, s, t) of `rank`, from the definition."""
    t_size, s_size = dims.tensor_size, dims.sequence_size
    z_size = dims.shard_group_size // s_size
    t = rank % t_size
    s = rank // t_size % s_size
    z = rank // (t_size * s_size) % z_size
    r = rank // (t_size * s_size * z_size)
    return r, z, s, t


def _expected_group(dims: ParallelDims, rank: int, label: str) -> list[int]:
    """Ranks sharing every coordinate but the group's own ones."""
    mine = _coordinates(dims, rank)
    varies = {
        TENSOR: {3},
        SEQUENCE: {2},
        SHARD: {1, 2},  # a shard group spans its data and sequence ranks
        REPLICA: {0},
        SLICE: {0, 1, 2},  # every rank with the same tensor rank: the same values
    }[label]
    return [
        other
        for other in range(dims.world_size)
        if all(
            a == b
            for i, (a, b) in enumerate(zip(_coordinates(dims, other), mine, strict=True))
            if i not in varies
        )
    ]


@pytest.mark.parametrize(("world", "shard", "seq", "tensor", "hpz"), MESHES)
def test_groups_follow_the_mesh(world: int, shard: int, seq: int, tensor: int, hpz: int) -> None:
    for rank in range(world):
        dims = ParallelDims.build(
            world,
            rank,
            shard_group_size=shard,
            sequence_size=seq,
            tensor_size=tensor,
            secondary_size=hpz,
        )
        for label in (TENSOR, SEQUENCE, SHARD, REPLICA, SLICE):
            groups = dims.groups_of(label)
            assert sorted(itertools.chain(*groups)) == list(range(world)), label
            assert dims.own_group(label) == _expected_group(dims, rank, label), (label, rank)
            assert len(dims.own_group(label)) == dims.group_size(label)
        r, z, s, t = _coordinates(dims, rank)
        assert (dims.replica_index, dims.tensor_rank, dims.sequence_rank) == (r, t, s)
        assert dims.shard_rank == z * seq + s
        assert dims.data_index == r * dims.shard_data_size + z
        assert dims.data_size * seq * tensor == world
        if hpz > 1:
            secondary = dims.own_group(SECONDARY)
            assert set(secondary) <= set(dims.own_group(SHARD)) and len(secondary) == hpz


def test_the_ranks_holding_the_same_values_are_the_slice_group() -> None:
    """Rule 4: without tensor parallelism every rank holds the same values; with it, the
    ranks of one tensor rank (a shard group and its replicas) do, and a checkpoint's
    shards of tensor rank t live on that tensor rank's shard groups."""
    assert ParallelDims.build(4, 1).same_values_label() == WORLD
    dims = ParallelDims.build(8, 5, shard_group_size=2, tensor_size=2)
    assert dims.same_values_label() == SLICE
    assert dims.own_group(SLICE) == [1, 3, 5, 7]
    assert dims.shard_group_ranks(0, 1) == [1, 3] and dims.shard_group_ranks(1, 0) == [4, 6]
    assert dims.own_group(SHARD) == dims.shard_group_ranks(dims.replica_index, 1)
    # T over every rank: each shard group is one rank, and still a group of its own.
    alone = ParallelDims.build(2, 0, tensor_size=2)
    assert alone.shard_group_size == 1 and alone.needs_group(SHARD) and not alone.needs_group(SLICE)
    assert not ParallelDims.build(4, 0).needs_group(SHARD)


def test_tensor_and_sequence_groups_are_consecutive_ranks() -> None:
    dims = ParallelDims.build(16, 5, sequence_size=2, tensor_size=2)
    assert dims.own_group(TENSOR) == [4, 5]
    assert dims.own_group(SEQUENCE) == [5, 7]
    assert dims.tensor_groups()[:2] == [[0, 1], [2, 3]]
    seq_only = ParallelDims.build(8, 5, sequence_size=2)
    assert seq_only.own_group(SEQUENCE) == [4, 5]  # replica d holds ranks 2d, 2d+1


def test_the_ranks_of_a_sequence_and_tensor_block_read_the_same_samples() -> None:
    world, seq, tensor = 16, 2, 2
    index = [
        ParallelDims.build(world, r, sequence_size=seq, tensor_size=tensor).data_index
        for r in range(world)
    ]
    assert index == [r // (seq * tensor) for r in range(world)]


@pytest.mark.parametrize(("world", "shard", "seq", "tensor", "hpz"), MESHES)
def test_the_divisors_average_over_every_data_rank_once(
    world: int, shard: int, seq: int, tensor: int, hpz: int
) -> None:
    """Summed over a shard group then a replica group, each divided as the dims say, a
    gradient is the sum over the sequence ranks averaged over the data ranks."""
    dims = ParallelDims.build(
        world, 0, shard_group_size=shard, sequence_size=seq, tensor_size=tensor
    )
    total = dims.gradient_divisor(SHARD) * dims.gradient_divisor(REPLICA)
    assert total == dims.data_size == world // (seq * tensor)
    with pytest.raises(ValueError, match="not reduced over 'tensor'"):
        dims.gradient_divisor(TENSOR)


def test_a_norm_counts_each_element_once() -> None:
    dims = ParallelDims.build(8, 0, shard_group_size=2, tensor_size=2)
    assert dims.norm_sum_groups(sharded=True) == (SHARD,)  # replicas hold copies
    assert dims.norm_sum_groups(sharded=False) == ()  # stage 0: every rank holds it all
    assert dims.norm_sum_groups(sharded=True, tensor_split=True) == (SHARD, TENSOR)
    assert dims.norm_sum_groups(sharded=False, tensor_split=True) == (TENSOR,)
    alone = ParallelDims.build(1, 0)
    assert alone.norm_sum_groups(sharded=True, tensor_split=True) == ()


@pytest.mark.parametrize(
    ("world", "shard", "seq", "tensor", "expected"),
    [
        (8, -1, 3, 1, "sequence_parallel_size 3 x tensor_parallel.autotp_size 1 = 3 does not"),
        (8, -1, 2, 3, "= 6 does not divide the world size 8"),
        (8, 3, 1, 1, "mics_shard_size 3 does not divide the world size 8"),
        (8, 3, 1, 2, "mics_shard_size 3 does not divide the 4 ranks that shard each"),
        (8, 2, 4, 1, "mics_shard_size 2 splits a sequence group of 4 ranks"),
        (8, -1, 0, 1, "sequence_parallel_size must be at least 1"),
    ],
)
def test_sizes_that_do_not_fit_name_the_fix(
    world: int, shard: int, seq: int, tensor: int, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        ParallelDims.build(world, 0, shard_group_size=shard, sequence_size=seq, tensor_size=tensor)


@pytest.mark.parametrize("length", [1, 7, 12, 13, 16, 17])
@pytest.mark.parametrize("seq", [1, 2, 3, 4])
def test_the_sequence_ranks_hold_equal_consecutive_slices_of_the_padded_sequence(
    length: int, seq: int
) -> None:
    """Rule 4: ceil(L / S) tokens each, in rank order, covering every token once; the padding
    (fewer than S tokens) at the end."""
    world = 2 * seq
    slices = [
        ParallelDims.build(world, r, sequence_size=seq).sequence_slice(length) for r in range(world)
    ]
    local = -(-length // seq)
    for rank, piece in enumerate(slices):
        s = rank % seq
        assert (piece.start, piece.stop, piece.local_length) == (s * local, (s + 1) * local, local)
        assert piece.padded_length == local * seq and 0 <= piece.padding < seq
    covered = [t for piece in slices[:seq] for t in range(piece.start, piece.stop)]
    assert covered == list(range(local * seq))


def test_the_batch_sizes_count_data_ranks() -> None:
    assert data_parallel_size(8, 2) == 4
    assert data_parallel_size(8, 2, 2) == 2
    assert data_parallel_size(8) == 8
    with pytest.raises(ConfigError, match="sequence_parallel_size 3"):
        data_parallel_size(8, 3)


def test_sequence_and_tensor_dimensions_compose() -> None:
    """S x T: a tensor group is T consecutive ranks, a sequence group the S ranks with the same
    tensor rank inside one data rank's block, and a shard group every data and sequence rank
    holding the same tensor rank."""
    dims = ParallelDims.build(8, 5, sequence_size=2, tensor_size=2)  # 2 data ranks
    assert dims.own_group(TENSOR) == [4, 5]
    assert dims.own_group(SEQUENCE) == [5, 7]
    assert dims.own_group(SHARD) == [1, 3, 5, 7]
    assert (dims.data_size, dims.data_index) == (2, 1)
    assert dims.gradient_divisor(SHARD) == 2  # the data ranks of the shard group
    assert dims.norm_sum_groups(sharded=True, tensor_split=True) == (SHARD, TENSOR)


@pytest.mark.parametrize(("world", "shard", "seq", "tensor", "hpz"), MESHES)
def test_saved_window_sums_combine_as_the_boundary_reduction_would(
    world: int, shard: int, seq: int, tensor: int, hpz: int
) -> None:
    """Each rank's local sum, combined as the saved dims say, is the sum over the sequence
    ranks averaged over the data ranks of the ranks holding that tensor slice: checked against
    the mesh's definition with a closed form (rank r contributes r + 1)."""
    dims = ParallelDims.build(
        world, 0, shard_group_size=shard, sequence_size=seq, tensor_size=tensor
    )
    data = world // (seq * tensor)
    for t in range(tensor):
        sources = dims.window_sum_sources(t)
        assert sorted(sources.ranks) == [r for r in range(world) if _coordinates(dims, r)[3] == t]
        assert sources.divisor == data
        # Per data rank, the sequence ranks' parts add up; the data ranks are averaged.
        expected = sum(r + 1 for r in range(world) if _coordinates(dims, r)[3] == t) / data
        assert sum(r + 1 for r in sources.ranks) / sources.divisor == expected
    with pytest.raises(ValueError, match="tensor rank"):
        dims.window_sum_sources(tensor)


@pytest.mark.parametrize(("world", "shard", "seq", "tensor", "hpz"), MESHES)
def test_dims_round_trip_through_a_checkpoint_record(
    world: int, shard: int, seq: int, tensor: int, hpz: int
) -> None:
    dims = ParallelDims.build(
        world, 3, shard_group_size=shard, secondary_size=hpz, sequence_size=seq, tensor_size=tensor
    )
    back = ParallelDims.from_record(dims.to_record(), rank=3)
    assert back == dims and back.same_layout(dims)
    other = ParallelDims.from_record({**dims.to_record(), "world_size": world * 2}, rank=3)
    assert not other.same_layout(dims)


@pytest.mark.parametrize(
    "record",
    [
        None,
        {"world_size": 4},
        {
            "world_size": 4,
            "shard_group_size": 4,
            "secondary_size": 1,
            "sequence_size": 3,
            "tensor_size": 1,
        },
        {
            "world_size": True,
            "shard_group_size": 1,
            "secondary_size": 1,
            "sequence_size": 1,
            "tensor_size": 1,
        },
        {
            "world_size": 0,
            "shard_group_size": 1,
            "secondary_size": 1,
            "sequence_size": 1,
            "tensor_size": 1,
        },
    ],
)
def test_a_damaged_dims_record_is_refused(record: object) -> None:
    with pytest.raises(ValueError):
        ParallelDims.from_record(record)


def test_an_unknown_kind_of_group_is_an_error_not_the_world() -> None:
    dims = ParallelDims.build(4, 1, sequence_size=2)
    assert dims.groups_of(WORLD) == [[0, 1, 2, 3]] and dims.group_size(WORLD) == 4
    with pytest.raises(ValueError, match="no kind of group is called 'sequnce'"):
        dims.groups_of("sequnce")
    with pytest.raises(ValueError, match="no kind of group is called 'experts'"):
        dims.group_size("experts")


def test_a_reported_loss_is_averaged_over_the_data_ranks() -> None:
    """Every rank of a sequence and tensor group reports its batch's loss alike: summed over
    the world, each data rank's loss is counted S x T times."""
    for world, seq, tensor in ((8, 2, 2), (8, 1, 1), (8, 4, 1), (6, 1, 3)):
        dims = ParallelDims.build(world, 0, sequence_size=seq, tensor_size=tensor)
        losses = {d: float(d + 1) for d in range(dims.data_size)}  # one loss per data rank
        reported = [
            losses[ParallelDims.build(world, r, sequence_size=seq, tensor_size=tensor).data_index]
            for r in range(world)
        ]
        mean = sum(losses.values()) / len(losses)
        assert sum(reported) / dims.reported_value_divisor() == pytest.approx(mean)
        assert dims.ranks_per_batch == seq * tensor


def test_a_world_sum_of_tensor_slices_has_no_divisor() -> None:
    assert ParallelDims.build(4, 0, sequence_size=2).gradient_divisor(WORLD) == 2
    dims = ParallelDims.build(4, 0, tensor_size=2)
    assert dims.gradient_divisor(SLICE) == 2
    with pytest.raises(ValueError, match="slice group"):
        dims.gradient_divisor(WORLD)


# (world, sequence, expert, mics shard size or -1, tensor)
EXPERT_MESHES = [
    (2, 1, 2, -1, 1),
    (4, 1, 2, -1, 1),
    (4, 1, 4, -1, 1),
    (4, 2, 2, -1, 1),
    (8, 2, 4, -1, 1),
    (8, 2, 2, -1, 2),
    (8, 1, 2, 4, 1),
]


@pytest.mark.parametrize(("world", "seq", "expert", "shard", "tensor"), EXPERT_MESHES)
def test_expert_groups_split_each_shard_group_into_ep_and_expert_data_groups(
    world: int, seq: int, expert: int, shard: int, tensor: int
) -> None:
    """An EP group is E consecutive places of a shard group (different tokens, different
    experts); an expert-data group the places with the same expert rank. Together they
    are the shard group: each of its places is one (EP rank, expert-data rank)."""
    for rank in range(world):
        dims = ParallelDims.build(
            world,
            rank,
            shard_group_size=shard,
            sequence_size=seq,
            tensor_size=tensor,
            expert_size=expert,
        )
        shard_group = dims.own_group(SHARD)
        ep, data = dims.own_group(EXPERT), dims.own_group(EXPERT_DATA)
        for label in (EXPERT, EXPERT_DATA):
            groups = dims.groups_of(label)
            assert sorted(itertools.chain(*groups)) == list(range(world)), label
            assert len(dims.own_group(label)) == dims.group_size(label)
        place = shard_group.index(rank)
        assert ep == shard_group[place - place % expert : place - place % expert + expert]
        assert data == shard_group[place % expert :: expert]
        assert dims.expert_rank == ep.index(rank) and dims.expert_data_rank == data.index(rank)
        assert set(ep) & set(data) == {rank} and len(ep) * len(data) == len(shard_group)
        # Rule 1: an expert's gradient summed over its expert-data group is divided by the
        # data ranks of the shard group, as every other gradient: not by E or the group.
        assert dims.gradient_divisor(EXPERT_DATA) == dims.gradient_divisor(SHARD)
        assert dims.gradient_divisor(EXPERT_DATA) == dims.shard_data_size
        if seq == expert and shard == -1:
            assert ep == dims.own_group(SEQUENCE)  # E x S over the same ranks


def test_an_experts_norm_counts_each_element_once() -> None:
    dims = ParallelDims.build(4, 0, expert_size=2)
    # Shards (stages 1-3): disjoint over the expert-data group, experts over the EP group.
    assert dims.norm_sum_groups(sharded=True, expert=True) == (SHARD,)
    # Whole experts (stage 0): copies over the expert-data group, different over EP.
    assert dims.norm_sum_groups(sharded=False, expert=True) == (EXPERT,)
    assert dims.norm_sum_groups(sharded=False) == ()


@pytest.mark.parametrize(
    ("world", "seq", "expert", "expected"),
    [
        (4, 1, 3, "autoep_size 3 does not divide the 4 ranks that read different tokens"),
        (4, 2, 4, None),
        (4, 2, 8, "autoep_size 8 does not divide the 4 ranks"),
        (2, 1, 0, "expert_parallel.autoep_size must be at least 1"),
    ],
)
def test_expert_sizes_that_do_not_fit_name_the_fix(
    world: int, seq: int, expert: int, expected: str | None
) -> None:
    if expected is None:
        assert ParallelDims.build(world, 0, sequence_size=seq, expert_size=expert).splits_experts
        return
    with pytest.raises(ConfigError, match=expected):
        ParallelDims.build(world, 0, sequence_size=seq, expert_size=expert)


def test_the_expert_size_is_recorded() -> None:
    dims = ParallelDims.build(4, 1, expert_size=2)
    assert ParallelDims.from_record(dims.to_record(), rank=1) == dims
    older = {k: v for k, v in dims.to_record().items() if k != "expert_size"}
    assert ParallelDims.from_record(older).expert_size == 1  # before expert parallelism


def test_inside_join_the_gradient_is_the_mean_over_the_ranks_still_training() -> None:
    """Ranks that ran out add zeros to the sum the D-way average divides: the scale makes
    it the mean of the training ranks' gradients."""
    dims = ParallelDims.build(4, 0)
    grads = [1.0, 2.0, 6.0]  # three ranks train; the fourth contributes 0
    averaged = sum(grads) / dims.gradient_divisor(WORLD)
    assert averaged * dims.joined_gradient_scale(3) == pytest.approx(sum(grads) / 3)
    assert dims.joined_gradient_scale(4) == 1.0
    with pytest.raises(ValueError):
        dims.joined_gradient_scale(0)


def test_a_checkpoint_from_before_recorded_dims_is_read_as_replicas_of_data_ranks() -> None:
    dims = ParallelDims.from_replicas(8, 2)
    assert (dims.num_replicas, dims.shard_group_size, dims.data_size) == (2, 4, 8)
    assert dims.same_layout(ParallelDims.build(8, 3, shard_group_size=4))
    for world, replicas in ((8, 3), (8, 0), (4, 8), (8, "2")):
        with pytest.raises(ValueError):
            ParallelDims.from_replicas(world, replicas)
