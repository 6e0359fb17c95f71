"""What failure handling sees of a `Comm`: the narrow interface it depends on.

The collectives (`zerodp.comm.collectives.Comm`) call into failure handling; failure
handling never imports them (a contract in pyproject.toml). The two places here that are
handed a `Comm` see only these protocols, which `Comm` satisfies structurally.
"""

from __future__ import annotations

from typing import Any, Protocol

from zerodp.comm.faults.collective_history import CollectiveHistory
from zerodp.comm.faults.failure_notices import FailureBoard
from zerodp.comm.faults.polled_waits import OnStall


class EndingComm(Protocol):
    """A `Comm` as the teardown at exit sees it ([Note: ending the process])."""

    @property
    def group(self) -> Any:
        """Its process group (None: the default group)."""

    @property
    def world_size(self) -> int: ...

    @property
    def history(self) -> CollectiveHistory:
        """Its collectives; `history.broken` once one of them failed."""

    def has_in_flight(self) -> bool:
        """Whether a collective it issued asynchronously has not been waited for."""


class WatchedComm(Protocol):
    """A `Comm` as the collective order check sees it ([Note: collective order]): it adds
    its pass notices to the comm's failure boards and its check to the comm's waits."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def failure_boards(self) -> list[FailureBoard]: ...

    on_stall: OnStall | None

    def agree_first(self, kind: str, label: str | None = None) -> None:
        """Before a collective (`kind`): agree on this rank's activity with every rank, if it
        began one since ([Note: agreeing before a collective] in `zerodp.comm.agreement`)."""


class AgreeingComm(Protocol):
    """A `Comm` as the agreement before a collective sees it ([Note: agreeing before a
    collective] in `zerodp.comm.agreement`, which the collectives call: it must not import
    them back)."""

    @property
    def group(self) -> Any: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def watches_stalls(self) -> bool: ...

    @property
    def history(self) -> CollectiveHistory: ...

    @property
    def stats(self) -> Any:
        """Its `CommStats` (the agreement's bytes are counted apart)."""

    on_stall: OnStall | None

    def agree_first(self, kind: str, label: str | None = None) -> None: ...


class AgreeingGroups(Protocol):
    """The `GroupComms` of an engine as the agreement sees them: the dims (which groups a
    shard group is), and the labels of the groups inside a shard group."""

    @property
    def dims(self) -> Any: ...

    def inside_shard_group(self) -> Any: ...
