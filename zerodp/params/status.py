"""The gather state of a stage 3 parameter."""

from __future__ import annotations

import enum


class ParamStatus(enum.Enum):
    """Whether a stage 3 parameter's full data is present on this rank.

    NOT_AVAILABLE: only this rank's shard exists; the parameter's storage is empty.
    INFLIGHT: an all-gather into the parameter's storage has been issued, not waited on.
    AVAILABLE: the full parameter is present and may be read.
    """

    NOT_AVAILABLE = "not_available"
    INFLIGHT = "inflight"
    AVAILABLE = "available"
