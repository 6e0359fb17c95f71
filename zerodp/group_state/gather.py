"""The gather state of one sharded (stage 3) group, and the collectives that change it.

[Note: stage 3 storage]
Autograd saves the tensors a backward formula needs, often a view of a
parameter rather than the parameter itself (`F.linear` saves `weight.t()`).
zerodp never replaces a parameter's data with another tensor. Releasing a
group resizes the storage of its full buffer to zero, in place; gathering
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

import enum
from typing import Any

from zerodp.comm import Comm, Handle
from zerodp.errors import ParamStateError
from zerodp.group_state.secondary import SecondaryShard
from zerodp.partition import FlatGroup


class ParamStatus(enum.Enum):
    """Whether a stage 3 parameter's full data is present on this rank.

    NOT_AVAILABLE: only this rank's shard exists; the parameter's storage is
        empty (memory: the shard only).
    INFLIGHT: an all-gather into the parameter's storage has been issued, not
        waited on (memory: the full buffer is allocated).
    AVAILABLE: the full parameter is present and may be read.
    """

    NOT_AVAILABLE = "not_available"
    INFLIGHT = "inflight"
    AVAILABLE = "available"


class GatherState:
    """A sharded group's status, the users holding it, and its gather in flight.

    Transitions are named after the state they reach and check where they
    come from; a wrong order raises `ParamStateError` naming the parameters.
    Building one frees the group's full buffer: a sharded group starts
    NOT_AVAILABLE. `comm` is the group the shards are spread over (the shard
    group); with `secondary` (hpZ) a gather uses the secondary shards while they
    are valid (see [Note: hpZ secondary shard]).
    """

    def __init__(
        self, flat: FlatGroup, comm: Comm, secondary: SecondaryShard | None = None
    ) -> None:
        if flat.persistent:
            raise ValueError(f"{flat} is persistent: its full buffer is never released")
        self.flat = flat
        self.comm = comm
        self.secondary = secondary
        self._from_primary = False  # the gather in flight reads the primary shards
        self._numel = flat.padded_numel  # asked at every prefetch decision: computed once
        self.holds = 0  # forward scopes and GatheredParameters blocks using the group now
        # Forward scopes reading the group now, and whether a forward pass is running: in
        # one, a gathered group has the plain class only while claimed (see `claim`).
        self.claims = 0
        self._in_forward_pass = False
        # Left gathered at a forward's end for the head of its backward; released once no
        # backward can come ([Note: kept for the backward's head], params.forward_graphs).
        self.kept_for_backward = False
        self._handle: Handle | None = None  # set exactly while INFLIGHT
        # (class while gathered, class otherwise) of the group's parameters; see `guard_with`.
        self._classes: tuple[type[Any], type[Any]] | None = None
        flat.free_full()
        self.status = ParamStatus.NOT_AVAILABLE

    def guard_with(self, plain: type[Any], guarded: type[Any]) -> None:
        """Give the parameters class `guarded` while released, `plain` while gathered
        (in a forward pass: while gathered and claimed, see `set_forward_pass`).

        A guarded class (`ZeroParameter`) runs Python before every torch operation on
        its parameters, which a released parameter needs (its storage is empty);
        while gathered, `plain` (`nn.Parameter`) lets operations take torch's own fast
        path. Same object, only `__class__` changes, so every reference stays valid.
        """
        self._classes = (plain, guarded)
        current = plain if self._gathered_class() == 0 else guarded
        for param in self.flat.params:
            param.__class__ = current

    def unguard(self, plain: type[Any]) -> None:
        """Stop changing classes; the parameters keep class `plain` from now on."""
        self._classes = None
        for param in self.flat.params:
            param.__class__ = plain

    def _gathered_class(self) -> int:
        """Which of `_classes` the parameters have now: 0 plain, 1 guarded."""
        if self.status is not ParamStatus.AVAILABLE:
            return 1
        return 1 if self._in_forward_pass and not self.claims else 0

    def _set_class(self, index: int) -> None:
        classes = self._classes
        if classes is not None:
            cls = classes[index]
            for param in self.flat.params:
                param.__class__ = cls

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def gathers_from_secondary(self) -> bool:
        """Whether the next gather reads the secondary shards (hpZ, while they are valid)."""
        return self.secondary is not None and self.secondary.valid

    @property
    def next_gather_label(self) -> str:
        """The label of the group the next gather runs in (the hpZ group or the shard group)."""
        secondary = self.secondary
        return (
            secondary.comm.label if secondary is not None and secondary.valid else self.comm.label
        )

    def shard_changed(self) -> None:
        """The group's values changed (a step, a load, a published write): a secondary shard
        is stale from now on (see [Note: hpZ secondary shard])."""
        if self.secondary is not None:
            self.secondary.invalidate()

    # -- transitions (named after the state they reach) -------------------------------

    def to_inflight(self) -> None:
        """Start gathering: allocate the full storage and issue the all-gather.

        An offloaded shard (host memory or a file) is first copied into this rank's
        chunk of the full buffer, which the all-gather then reads in place.
        """
        self._require({ParamStatus.NOT_AVAILABLE}, ParamStatus.INFLIGHT)
        flat = self.flat
        flat.alloc_full()
        if self.secondary is not None and self.secondary.valid:
            self._handle = self.secondary.gather_into(flat.full)
            self._from_primary = False
            self.status = ParamStatus.INFLIGHT
            return
        self._from_primary = True
        source = flat.shard
        if flat.shard_offloaded:
            start, end = flat.shard_range
            source = flat.full[start:end]
            source.copy_(flat.shard, non_blocking=True)
        self._handle = self.comm.all_gather(flat.full, source, async_op=True)
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
        if self._from_primary and self.secondary is not None:
            self.secondary.take_from(self.flat.full)  # before anything can write into it
        self._from_primary = False
        self.status = ParamStatus.AVAILABLE
        self._set_class(self._gathered_class())

    def to_not_available(self) -> None:
        """Release the full storage; only the shard remains."""
        self._require({ParamStatus.AVAILABLE}, ParamStatus.NOT_AVAILABLE)
        self._set_class(1)
        self.flat.free_full()
        self.status = ParamStatus.NOT_AVAILABLE
        self.kept_for_backward = False

    @property
    def releasable(self) -> bool:
        """Whether `release_if_unused` would release now: nobody holds it, and it is there
        (or on its way)."""
        return self.holds == 0 and self.status is not ParamStatus.NOT_AVAILABLE

    def release_if_unused(self) -> bool:
        """Release unless held; an in-flight gather is finished first. True if released."""
        if not self.releasable:
            return False
        if self.status is ParamStatus.INFLIGHT:
            self.to_available()
        self.to_not_available()
        return True

    def keep_for_backward(self) -> None:
        """Stay gathered after the forward that ends now, for its backward's head."""
        if self.status is ParamStatus.NOT_AVAILABLE:
            raise ParamStateError(
                f"parameters {self.shown_names()}: cannot be kept gathered for a backward "
                "while NOT_AVAILABLE"
            )
        self.kept_for_backward = True

    # -- users ---------------------------------------------------------------------

    def hold(self) -> None:
        self.holds += 1

    def unhold(self) -> None:
        """Drop one hold; an unbalanced call is a bug in the caller, not something to hide."""
        if self.holds <= 0:
            raise ParamStateError(
                f"parameters {self.shown_names()}: released more often than held "
                "(GatheredParameters exited twice, or a forward scope was unwound twice)"
            )
        self.holds -= 1

    def drop_holds(self) -> None:
        """Forget every hold (a forward or backward died part-way; its scopes are gone)."""
        self.holds = 0
        self.claims = 0

    # -- forward scopes (see [Note: saving windows] in zerodp.stage3.saved_tensors) -------

    def set_forward_pass(self, running: bool) -> None:
        """A forward pass begins (`True`) or ends: while one runs, a gathered group that no
        forward scope claims keeps the guarded class, so that any operation reading it goes
        through `ZeroParameter`, which claims it for the scope running the operation."""
        self._in_forward_pass = running
        if self.status is ParamStatus.AVAILABLE:
            self._set_class(self._gathered_class())

    def claim(self) -> None:
        """A forward scope reads the group until it ends: plain class while gathered."""
        self.claims += 1
        if self.claims == 1 and self.status is ParamStatus.AVAILABLE:
            self._set_class(0)

    def unclaim(self) -> None:
        if self.claims <= 0:
            raise ParamStateError(
                f"parameters {self.shown_names()}: unclaimed more often than claimed"
            )
        self.claims -= 1
        if not self.claims and self.status is ParamStatus.AVAILABLE:
            self._set_class(self._gathered_class())

    # -- checks ----------------------------------------------------------------------

    def _require(self, allowed: set[ParamStatus], target: ParamStatus) -> None:
        if self.status not in allowed:
            shown = " or ".join(sorted(s.name for s in allowed))
            raise ParamStateError(
                f"parameters {self.shown_names()}: cannot go from {self.status.name} to "
                f"{target.name} (allowed only from {shown})"
            )

    def shown_names(self) -> str:
        names = self.flat.names
        return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")

    def __repr__(self) -> str:
        return f"GatherState({self.shown_names()}; {self.status.name}, holds={self.holds})"
