"""The order in which stage 3 groups were used, recorded once and replayed to prefetch.

The first forward (and, separately, the first backward) records the sequence
of groups the modules asked for. Later passes compare each request with the
recording: while they match, the groups due next are gathered ahead of time,
up to `stage3_prefetch_bucket_size` elements. The first request that does not
match (a different branch was taken) stops prefetching for the rest of that
pass, and the next pass records afresh. Prefetching is a speed-up only: a
group that is needed and not prefetched is gathered on demand, and a group
prefetched but not used is released at the end of the pass.

Every rank must run the same modules in the same order (a stage 3 gather is a
collective), so every rank makes the same prefetch decisions.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class TracePhase(enum.Enum):
    """What a trace does with the next request.

    RECORDING: it notes the order (first pass, or the pass after a divergence).
    REPLAYING: it compares each request with the recording and prefetches ahead.
    DIVERGED: this pass left the recording; no prefetching until the next pass.
    """

    RECORDING = "recording"
    REPLAYING = "replaying"
    DIVERGED = "diverged"


class ExecutionTrace(Generic[T]):
    """The order of one kind of pass (forward or backward), recorded once and replayed.

    `weight` gives each item's size (a group's elements). A recording keeps its
    running total of sizes and where each item occurs, so that the questions
    asked at every request ("what is due within this many elements", "is this
    item used again, and how far ahead") cost a bisection, not a walk over the
    rest of the pass: a walk per request made a pass quadratic in its length.
    """

    def __init__(self, weight: Callable[[T], int]) -> None:
        self.phase = TracePhase.RECORDING
        self._weight = weight
        self._recorded: list[T] = []
        self._recording: list[T] = []
        self._position = 0
        self._prefix: list[int] = [0]  # _prefix[i]: total weight of _recorded[:i]
        self._where: dict[T, list[int]] = {}  # item -> its positions in _recorded, ascending
        self.frontier = 0  # the prefetcher looked at every item before this one in this pass
        self.num_divergences = 0

    def _set_recorded(self, items: list[T]) -> None:
        self._recorded = items
        prefix = [0]
        where: dict[T, list[int]] = {}
        for index, item in enumerate(items):
            prefix.append(prefix[-1] + self._weight(item))
            where.setdefault(item, []).append(index)
        self._prefix = prefix
        self._where = where

    def begin_pass(self) -> None:
        self._position = 0
        self.frontier = 0
        if self.phase is TracePhase.REPLAYING and self._recorded:
            return
        self.phase = TracePhase.RECORDING
        self._recording = []

    def end_pass(self) -> None:
        if self.phase is TracePhase.RECORDING and self._recording:
            self._set_recorded(self._recording)
            self._recording = []
            self.phase = TracePhase.REPLAYING
        elif self.phase is TracePhase.REPLAYING and self._position != len(self._recorded):
            # The pass stopped early or ran longer: record the next one afresh.
            self.phase = TracePhase.DIVERGED
            self.num_divergences += 1

    @property
    def recorded(self) -> list[T]:
        return list(self._recorded)

    def seed(self, items: list[T]) -> None:
        """Start replaying a guess (e.g. the forward order reversed) before anything is recorded."""
        if not self._recorded and self.phase is TracePhase.RECORDING and items:
            self._set_recorded(list(items))
            self.phase = TracePhase.REPLAYING

    @property
    def position(self) -> int:
        """Index of the next expected item in the recording."""
        return self._position

    def item(self, index: int) -> T:
        return self._recorded[index]

    def window_end(self, budget: int) -> int:
        """The end of the items due next whose sizes, counted from the next one on, start
        within `budget` (every use counts, a repeated item too); the position if not replaying."""
        if self.phase is not TracePhase.REPLAYING:
            return self._position
        end = bisect.bisect_left(self._prefix, self._prefix[self._position] + budget)
        return min(end, len(self._recorded))

    def weight_ahead(self) -> int:
        """The total size of what the recording expects for the rest of this pass."""
        if self.phase is not TracePhase.REPLAYING:
            return 0
        return self._prefix[-1] - self._prefix[self._position]

    def reuse_distance(self, item: T) -> int | None:
        """The size of what comes before `item`'s next use in this pass; None if none is due."""
        if self.phase is not TracePhase.REPLAYING:
            return None
        positions = self._where.get(item)
        if not positions:
            return None
        at = bisect.bisect_left(positions, self._position)
        if at == len(positions):
            return None
        return self._prefix[positions[at]] - self._prefix[self._position]

    def request(self, item: T) -> bool:
        """Note that `item` is requested now; True if the pass follows its recording here."""
        if self.phase is TracePhase.RECORDING:
            self._recording.append(item)
            return False
        if self.phase is TracePhase.DIVERGED:
            return False
        if self._position < len(self._recorded) and self._recorded[self._position] is item:
            self._position += 1
            return True
        self.phase = TracePhase.DIVERGED
        self.num_divergences += 1
        return False
