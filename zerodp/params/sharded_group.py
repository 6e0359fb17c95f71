"""A stage 3 group of parameters: gathered on use, released after, with a checked state.

[Note: stage 3 storage]
Autograd saves the tensors a backward formula needs, often a view of a
parameter rather than the parameter itself (`F.linear` saves `weight.t()`).
zerodp never replaces a parameter's data with another tensor. Releasing a
group resizes the storage of its flat buffer to zero, in place; gathering
resizes it back and all-gathers every rank's shard into it. Every tensor that
shares that storage (the parameters, and every view autograd saved) sees the
full data again whenever the group is gathered, so a second backward on a
retained graph only has to gather the groups again, and no group has to stay
gathered between backward passes. Reading a released parameter would read
freed memory: zerodp makes sure that never happens (`ZeroParameter` gathers
on use in forward and raises outside it; the saved-tensor hooks gather on
unpack in backward).
"""

from __future__ import annotations

from zerodp.comm import Comm, Handle
from zerodp.errors import ParamStateError
from zerodp.params.status import ParamStatus
from zerodp.partition import FlatGroup


class ShardedGroup:
    """The stage 3 view of a FlatGroup: its status and the collectives that change it."""

    def __init__(self, flat: FlatGroup, comm: Comm, persistent: bool) -> None:
        self.flat = flat
        self.comm = comm
        self.persistent = persistent
        self.status = ParamStatus.AVAILABLE
        self.holds = 0  # forward scopes and GatheredParameters blocks using the group now
        self._handle: Handle | None = None
        if not persistent:
            flat.free_full()
            self.status = ParamStatus.NOT_AVAILABLE

    @property
    def numel(self) -> int:
        return self.flat.padded_numel

    @property
    def names(self) -> list[str]:
        return self.flat.names

    # -- transitions (named after the state they reach) -------------------------------

    def to_inflight(self) -> None:
        """Start gathering: allocate the full storage and issue the all-gather."""
        self._require({ParamStatus.NOT_AVAILABLE}, ParamStatus.INFLIGHT)
        self.flat.alloc_full()
        self._handle = self.comm.all_gather(self.flat.full, self.flat.shard, async_op=True)
        self.status = ParamStatus.INFLIGHT

    def to_available(self) -> None:
        """Finish gathering (issuing it first when it was not in flight)."""
        if self.status is ParamStatus.AVAILABLE:
            return
        if self.status is ParamStatus.NOT_AVAILABLE:
            self.to_inflight()
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        self.status = ParamStatus.AVAILABLE

    def to_not_available(self) -> None:
        """Release the full storage; only the shard remains."""
        if self.persistent:
            raise ParamStateError(
                f"parameters {self._shown_names()} are persistent (below "
                "stage3_param_persistence_threshold) and are never released"
            )
        self._require({ParamStatus.AVAILABLE}, ParamStatus.NOT_AVAILABLE)
        self.flat.free_full()
        self.status = ParamStatus.NOT_AVAILABLE

    def release_if_unused(self) -> bool:
        """Release unless persistent or held; an in-flight gather is finished first."""
        if self.persistent or self.holds > 0 or self.status is ParamStatus.NOT_AVAILABLE:
            return False
        if self.status is ParamStatus.INFLIGHT:
            self.to_available()
        self.to_not_available()
        return True

    def refresh(self) -> None:
        """Re-gather a resident group after its shard changed (the optimizer step)."""
        self._require({ParamStatus.AVAILABLE}, ParamStatus.AVAILABLE)
        self.comm.all_gather(self.flat.full, self.flat.shard)

    def write_back_shard(self) -> None:
        """Take this rank's shard from the full buffer (after a rank wrote the full data)."""
        self._require({ParamStatus.AVAILABLE}, ParamStatus.AVAILABLE)
        if self.flat.separate_shard:
            start, end = self.flat.shard_range
            self.flat.shard.copy_(self.flat.full[start:end])

    # -- checks ----------------------------------------------------------------------

    def _require(self, allowed: set[ParamStatus], target: ParamStatus) -> None:
        if self.status not in allowed:
            shown = " or ".join(sorted(s.name for s in allowed))
            raise ParamStateError(
                f"parameters {self._shown_names()}: cannot go from {self.status.name} to "
                f"{target.name} (allowed only from {shown})"
            )

    def _shown_names(self) -> str:
        names = self.flat.names
        return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")

    def __repr__(self) -> str:
        return f"ShardedGroup({self._shown_names()}; {self.status.name}, holds={self.holds})"
