"""Which tokens of a sequence a sequence rank holds (rule 5 of [Note: parallel dimensions])."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence rank's tokens: [start, stop) of a sequence padded to `padded_length`.

    Rule 5 of [Note: parallel dimensions]: every rank holds the same number of tokens
    (ceil(length / S)), so the all-to-alls around attention exchange equal blocks; the
    padding, at most S - 1 tokens, is at the end of the sequence.
    """

    length: int
    padded_length: int
    start: int
    stop: int

    @classmethod
    def of(cls, length: int, size: int, rank: int) -> SequenceSlice:
        if length < 1:
            raise ValueError(f"a sequence needs at least one token, got length {length}")
        local = -(-length // size)
        return cls(length, local * size, rank * local, (rank + 1) * local)

    @property
    def local_length(self) -> int:
        return self.stop - self.start

    @property
    def padding(self) -> int:
        return self.padded_length - self.length
