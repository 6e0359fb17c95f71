"""zerodp's error types: one hierarchy, so `except zerodp.ZeroDPError` catches any of them.

Every type also derives from the built-in type a user would catch anyway
(`ValueError` for bad input, `RuntimeError` for a wrong order of calls,
`OSError` for storage), and every message names the fix.

When a check fails on some ranks only, every rank raises the same type with
the same message (see `zerodp.comm.Comm.raise_if_any_failed`), so an
`except` clause takes the same path everywhere and no rank is left waiting
in the next collective.
"""

from __future__ import annotations


class ZeroDPError(RuntimeError):
    """Base class of every error zerodp raises on purpose."""


class ConfigError(ZeroDPError, ValueError):
    """A configuration value is missing, misspelled, of the wrong type or out of range."""


class ConfigWarning(UserWarning):
    """A config was accepted, but some of its keys change nothing (each one says why)."""


class UsageError(ZeroDPError, ValueError):
    """An API was called with arguments, or in a mode, that zerodp cannot honour."""


class NonScalarLossError(UsageError, AssertionError):
    """`engine.backward`/`engine.scale` got a loss that is not a scalar.

    Also an `AssertionError`, which DeepSpeed raises here (its tests catch that type).
    """


class LifecycleError(ZeroDPError):
    """A call came in an order the engine cannot honour (e.g. `step()` inside backward)."""


class ParamStateError(ZeroDPError):
    """A stage 3 parameter was used in a way its gather state does not allow."""


class CheckpointError(ZeroDPError):
    """A checkpoint is missing, incomplete, corrupted, or for a different model."""


class CheckpointPathError(CheckpointError, ValueError):
    """A checkpoint directory or tag cannot be used as given (not a directory, bad tag)."""


class CheckpointStorageError(CheckpointError, OSError):
    """The storage refused a checkpoint operation (not writable, not found)."""


class LossScaleError(ZeroDPError):
    """fp16 gradients still overflow at the minimum loss scale."""


class DivergenceError(ZeroDPError):
    """Ranks issued different collectives at stage 3 (they ran different modules).

    Raised on every rank with the same message, naming what each rank was doing; the
    process group cannot be used afterwards (collectives are left waiting on it).
    """


class NonFiniteError(ZeroDPError, ArithmeticError):
    """A step's gradient norm is inf or NaN and the config says `"on_non_finite": "raise"`."""


class CollectiveError(ZeroDPError):
    """A collective failed or timed out; the message names it and this rank's recent ones."""


class PeerFailedError(CollectiveError):
    """Another rank failed (its error is named in the message), so this rank cannot go on."""


class UnevenInputsError(CollectiveError):
    """Ranks ran different numbers of steps (uneven inputs); the message says where each is."""


class AgreedError(ZeroDPError):
    """Another rank failed a check that every rank agreed on; the message quotes it."""


class UnsupportedFeatureError(ZeroDPError, AttributeError):
    """A DeepSpeed name zerodp does not implement (pipeline parallelism, MoE layers, inference
    kernels, ...), reached as an attribute; the message names the zerodp alternative.

    Also an `AttributeError`, so `hasattr(deepspeed, "PipelineModule")` stays False and code
    that probes for a feature takes its fallback.
    """


class UnsupportedModuleError(ZeroDPError, ModuleNotFoundError):
    """A DeepSpeed module zerodp does not implement (`deepspeed.pipe`, `deepspeed.moe`, ...),
    imported through zerodp; the message names the zerodp alternative.

    Also a `ModuleNotFoundError`, so `try: import ... except ImportError:` keeps working.
    """


# Types a failure on one rank may be re-raised as on every rank (by name, never unpickled).
AGREED_TYPES: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        ZeroDPError,
        ConfigError,
        UsageError,
        UnsupportedFeatureError,
        NonScalarLossError,
        LifecycleError,
        ParamStateError,
        DivergenceError,
        CollectiveError,
        PeerFailedError,
        UnevenInputsError,
        CheckpointError,
        CheckpointPathError,
        CheckpointStorageError,
        LossScaleError,
        NonFiniteError,
        ValueError,
        TypeError,
        KeyError,
        RuntimeError,
        OSError,
        PermissionError,
        FileNotFoundError,
        NotImplementedError,
    )
}
