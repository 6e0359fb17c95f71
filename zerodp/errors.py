"""zerodp's error types.

User mistakes raise subclasses of the built-in types a user would catch anyway
(`ValueError`, `TypeError`, `RuntimeError`), and every message names the fix.
"""

from __future__ import annotations


class ZeroDPError(RuntimeError):
    """Base class for zerodp's runtime errors."""


class ConfigError(ValueError):
    """A configuration value is missing, misspelled, of the wrong type or out of range."""


class ConfigWarning(UserWarning):
    """A config was accepted, but some of its keys change nothing (each one says why)."""


class LifecycleError(ZeroDPError):
    """A call came in an order the engine cannot honour (e.g. `step()` inside backward)."""


class ParamStateError(ZeroDPError):
    """A stage 3 parameter was asked for a transition its current state does not allow."""


class CheckpointError(ZeroDPError):
    """A checkpoint is missing, incomplete, corrupted, or for a different model."""
