"""How a weight split over the tensor ranks is cut, and which saved slices make up another cut
(rule 8 of [Note: parallel dimensions]).

A weight of `whole_shape` split along `dim` over T tensor ranks is cut into T equal,
consecutive ranges of that dimension; tensor rank t holds range t (what `torch.chunk`
makes, and what `zerodp.tensor_parallel` splits). T = 1 is the whole weight as one part.
A checkpoint writes part t flattened (row-major) at offset t x its size, so each layout
is one 1-D tensor of the whole weight's size. Seen as rows x width x inner (the sizes
before, along and after `dim`), part t holds columns [start_t, stop_t) of every row:
with one row (a split along the first non-trivial dimension) the parts in order are the
whole weight flattened, whatever T; with several rows they are not, and a load under
another T reads, for each piece of its own part, the rows of the saved parts beside it
(`TensorSlices.cover`). Pure arithmetic: `zerodp.checkpoint_io.tensor_relayout` reads and
assembles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PartRows:
    """The values one saved part contributes to a piece: its flattened values [start, stop)
    (whole rows), of which the columns [keep_start, keep_stop) (along the split dimension,
    counted inside the part) belong to the piece's part."""

    part: int
    start: int
    stop: int
    keep_start: int
    keep_stop: int


@dataclass(frozen=True)
class Cover:
    """Which saved values make up `length` values of one part of another cut.

    The piece lies in `rows` consecutive rows of its part; each saved part beside it gives
    those rows (`reads`, in column order); their kept columns side by side are the part's
    rows, and the piece starts `offset` values into them (flattened)."""

    rows: int
    inner: int
    offset: int
    length: int
    reads: tuple[PartRows, ...]


@dataclass(frozen=True)
class TensorSlices:
    """The parts of a weight of `whole_shape` cut along `dim`: part t holds `ranges[t]` of that
    dimension (equal and consecutive: see the module docstring)."""

    whole_shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, whole_shape: tuple[int, ...], dim: int, count: int) -> TensorSlices:
        """`count` equal slices along `dim`; `ValueError` naming both when they do not fit."""
        if not 0 <= dim < max(1, len(whole_shape)) or count < 1:
            raise ValueError(f"cannot cut a tensor of shape {list(whole_shape)} along dim {dim}")
        size = whole_shape[dim] if whole_shape else 1
        if size % count:
            raise ValueError(
                f"dim {dim} of shape {list(whole_shape)} ({size}) does not divide into "
                f"{count} tensor slices"
            )
        width = size // count
        return cls(
            tuple(whole_shape), dim, tuple((t * width, (t + 1) * width) for t in range(count))
        )

    @classmethod
    def whole(cls, whole_shape: tuple[int, ...], dim: int) -> TensorSlices:
        """A weight left whole, as one part (cut along `dim`, the other cut's dimension)."""
        return cls.of(whole_shape, dim, 1)

    @staticmethod
    def whole_shape_of(slice_shape: tuple[int, ...], dim: int, count: int) -> tuple[int, ...]:
        """The whole weight's shape from one of `count` slices along `dim`."""
        shape = list(slice_shape)
        shape[dim] *= count
        return tuple(shape)

    @property
    def count(self) -> int:
        return len(self.ranges)

    @property
    def rows(self) -> int:
        return math.prod(self.whole_shape[: self.dim])

    @property
    def inner(self) -> int:
        return math.prod(self.whole_shape[self.dim + 1 :])

    def width(self, part: int) -> int:
        start, stop = self.ranges[part]
        return stop - start

    def numel(self, part: int) -> int:
        return self.rows * self.width(part) * self.inner

    def offset(self, part: int) -> int:
        """Where part `part` starts in the checkpoint's 1-D tensor of every part."""
        return sum(self.numel(p) for p in range(part))

    def locate(self, offset: int) -> tuple[int, int]:
        """(part, offset inside it) of a value at `offset` of the 1-D tensor of every part."""
        for part in range(self.count):
            if offset < self.numel(part):
                return part, offset
            offset -= self.numel(part)
        raise ValueError(f"offset past the {self.count} parts of {list(self.whole_shape)}")

    def flat_order(self) -> tuple[tuple[int, int], ...]:
        """What decides the 1-D tensor's order: the same for two cuts that write the same
        1-D tensor (one row, or a single part, is the whole weight flattened)."""
        if self.rows == 1 or self.count == 1:
            return ()
        return self.ranges

    def cover(self, target: TensorSlices, part: int, start: int, length: int) -> Cover:
        """Which of these parts' values make up values [start, start + length) of `target`'s
        part `part` (flattened): per overlapping part, the whole rows the piece spans. Both
        cuts are of the same weight along the same dimension (a whole weight is cut along
        the other's: `of(shape, dim, 1)`)."""
        if target.whole_shape != self.whole_shape or target.dim != self.dim:
            raise ValueError(
                f"a cut of {list(self.whole_shape)} along dim {self.dim} cannot make one of "
                f"{list(target.whole_shape)} along dim {target.dim}"
            )
        if length < 1 or start < 0 or start + length > target.numel(part):
            raise ValueError(f"values [{start}, {start + length}) are not in part {part}")
        lo, hi = target.ranges[part]
        row_length = (hi - lo) * self.inner
        first, last = start // row_length, (start + length - 1) // row_length
        reads = []
        for saved, (begin, end) in enumerate(self.ranges):
            if end <= lo or begin >= hi:
                continue
            width = (end - begin) * self.inner
            keep = (max(lo, begin) - begin, min(hi, end) - begin)
            reads.append(PartRows(saved, first * width, (last + 1) * width, *keep))
        return Cover(last - first + 1, self.inner, start - first * row_length, length, tuple(reads))
