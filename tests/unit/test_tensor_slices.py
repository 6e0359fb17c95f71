"""Tensor-parallel cuts (rule 8 of [Note: parallel dimensions]) and the reads across them.

A checkpoint saved at T holds one 1-D tensor per parameter, part t (the slice `torch.chunk`
gives tensor rank t) flattened at offset t x its size. For every pair of degrees (T, T'),
every part of the new cut and pieces of it that start and end inside rows, the values the
relayout assembles from the saved rows `TensorSlices.cover` names equal the new slice cut
from the whole tensor with `torch.chunk`, bitwise (they are copies); local sums saved per
rank are summed and divided as the boundary would.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from zerodp.checkpoint_io.tensor_relayout import SavedParts, _Piece
from zerodp.parallel import ParallelDims
from zerodp.parallel.tensor_slices import TensorSlices

SHAPES = [((12, 8), 1), ((4, 6, 4), 1), ((24,), 0), ((8, 6), 0), ((2, 12), 1)]


def saved_tensor(whole: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    return torch.cat([part.reshape(-1) for part in whole.chunk(count, dim=dim)])


def pieces(numel: int) -> list[tuple[int, int]]:
    """Whole parts, halves, and ranges that start and stop inside rows."""
    found = {(0, numel), (0, numel // 2), (numel // 2, numel - numel // 2)}
    found |= {(1, numel - 2), (numel // 3, numel // 3 + 1), (numel - 1, 1)}
    return sorted((s, n) for s, n in found if n > 0 and s + n <= numel)


@pytest.mark.parametrize(("shape", "dim"), SHAPES)
def test_a_piece_of_another_cut_is_assembled_from_the_saved_rows(
    shape: tuple[int, ...], dim: int
) -> None:
    whole = torch.arange(float(torch.Size(shape).numel())).view(shape)
    counts = [c for c in (1, 2, 3, 4, 6) if shape[dim] % c == 0]
    for saved_count, count in itertools.product(counts, counts):
        saved_cut = TensorSlices.of(shape, dim, saved_count)
        cut = TensorSlices.of(shape, dim, count)
        flat = saved_tensor(whole, dim, saved_count)
        parts = SavedParts.one_tensor(saved_cut, "model.w")
        for part, sliced in enumerate(whole.chunk(count, dim=dim)):
            expected = sliced.reshape(-1)
            for start, length in pieces(cut.numel(part)):
                out = torch.full((length,), -1.0)
                piece = _Piece(parts, saved_cut.cover(cut, part, start, length), out)
                read = [key for key, _, _ in piece.reads()]
                assert set(read) == {"model.w"}
                piece.assemble(lambda key, a, b, flat=flat: flat[a:b])
                assert torch.equal(out, expected[start : start + length]), (
                    saved_count,
                    count,
                    part,
                    start,
                )


def test_the_rows_read_are_only_those_of_the_piece() -> None:
    """A row-parallel weight (8 rows, 12 columns) saved at T = 2, read at T' = 4: a piece of
    rows 2-3 of slice 1 (columns 3-5) reads rows 2-3 of saved part 0 only."""
    cut_2 = TensorSlices.of((8, 12), 1, 2)
    cut_4 = TensorSlices.of((8, 12), 1, 4)
    cover = cut_2.cover(cut_4, 1, 2 * 3, 2 * 3)
    assert [(r.part, r.start, r.stop, r.keep_start, r.keep_stop) for r in cover.reads] == [
        (0, 2 * 6, 4 * 6, 3, 6)
    ]
    # One row: the parts in order are the whole tensor flattened, whatever T.
    assert (
        TensorSlices.of((8, 12), 0, 2).flat_order() == TensorSlices.of((8, 12), 0, 4).flat_order()
    )
    assert cut_2.flat_order() != cut_4.flat_order()
    assert (
        TensorSlices.whole((8, 12), 1).flat_order() == TensorSlices.of((8, 12), 0, 2).flat_order()
    )


def test_local_sums_of_each_part_are_summed_and_averaged() -> None:
    """Two data ranks' local sums of each of T = 2 parts, loaded at T' = 1: each part is the
    sum of its ranks' values over D = 2, joined along the split dim."""
    shape, dim = (4, 6), 1
    sums = {r: torch.randn(shape, generator=torch.Generator().manual_seed(r)) for r in range(4)}
    dims = ParallelDims.build(4, 0, tensor_size=2)  # rank r: tensor rank r % 2
    saved_cut = dims.tensor_slices(shape, dim)
    local = {
        f"grad_local.rank{r}.w": sums[r].chunk(2, dim=dim)[r % 2].reshape(-1) for r in range(4)
    }
    sources = [dims.window_sum_sources(t) for t in range(2)]
    keys = tuple(tuple(f"grad_local.rank{r}.w" for r in s.ranks) for s in sources)
    parts = SavedParts(saved_cut, keys, (0, 0), sources[0].divisor)
    cut = TensorSlices.whole(shape, dim)
    out = torch.empty(24)
    piece = _Piece(parts, saved_cut.cover(cut, 0, 0, 24), out)
    piece.assemble(lambda key, a, b: local[key][a:b])
    expected = torch.cat(
        [sum(sums[r].chunk(2, dim=dim)[t] for r in s.ranks) / 2 for t, s in enumerate(sources)],
        dim=dim,
    )
    torch.testing.assert_close(out.view(shape), expected, rtol=0, atol=1e-6)


def test_a_cut_that_does_not_fit_names_both() -> None:
    with pytest.raises(ValueError, match="does not divide into 4 tensor slices"):
        ParallelDims.build(4, 0, tensor_size=4).tensor_slices((6, 6), 1)
    assert ParallelDims.build(4, 0, tensor_size=2).whole_shape((6, 3), 1) == (6, 6)
    with pytest.raises(ValueError, match="cannot make one"):
        TensorSlices.of((4, 4), 0, 2).cover(TensorSlices.of((4, 4), 1, 2), 0, 0, 4)


def test_the_saved_dims_are_read_from_the_record_or_the_older_entries() -> None:
    from zerodp.checkpoint_io import tensor_slices
    from zerodp.errors import CheckpointError

    entry = {"size": 2, "slices": {"w": 1}}
    record = ParallelDims.build(4, 0, tensor_size=2, sequence_size=2).to_record()
    shared = {"world_size": 4, "tensor_parallel": entry, "dims": record}
    assert tensor_slices.saved_dims(shared).to_record() == record
    # Before the dims were recorded: the world and T (all a cut needs).
    older = tensor_slices.saved_dims({"world_size": 4, "tensor_parallel": entry})
    assert (older.tensor_size, older.world_size) == (2, 4)
    assert tensor_slices.saved_dims({"world_size": 2}).tensor_size == 1
    for damaged in ({**record, "tensor_size": 4}, {**record, "world_size": 3}, [1]):
        with pytest.raises(CheckpointError, match="damaged"):
            tensor_slices.saved_dims({**shared, "dims": damaged})
