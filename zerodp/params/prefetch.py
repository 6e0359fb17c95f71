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

import enum
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
    """The order of one kind of pass (forward or backward), recorded once and replayed."""

    def __init__(self) -> None:
        self.phase = TracePhase.RECORDING
        self._recorded: list[T] = []
        self._recording: list[T] = []
        self._position = 0
        self.num_divergences = 0

    def begin_pass(self) -> None:
        self._position = 0
        if self.phase is TracePhase.REPLAYING and self._recorded:
            return
        self.phase = TracePhase.RECORDING
        self._recording = []

    def end_pass(self) -> None:
        if self.phase is TracePhase.RECORDING and self._recording:
            self._recorded = self._recording
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
            self._recorded = list(items)
            self.phase = TracePhase.REPLAYING

    def upcoming(self) -> list[T]:
        """What the recording expects next in this pass (nothing unless replaying)."""
        if self.phase is not TracePhase.REPLAYING:
            return []
        return self._recorded[self._position :]

    def request(self, item: T) -> list[T]:
        """Note that `item` is requested now; return the items expected next, in order."""
        if self.phase is TracePhase.RECORDING:
            self._recording.append(item)
            return []
        if self.phase is TracePhase.DIVERGED:
            return []
        if self._position < len(self._recorded) and self._recorded[self._position] is item:
            self._position += 1
            return self._recorded[self._position :]
        self.phase = TracePhase.DIVERGED
        self.num_divergences += 1
        return []
