"""A checkpoint phase run on every rank, its failure one `CheckpointError` on all of them.

Saving and loading write and read files rank by rank; a failure on one rank (a
full disk, a file DCP could not write) must not leave the others waiting in the
next collective. `agreed` runs one phase and agrees on its verdict
(`Comm.raise_if_any_failed`); `as_checkpoint_error` words any failure as the
error a user sees, naming the rank, the root cause and what was left intact.
"""

from __future__ import annotations

from collections.abc import Callable

from zerodp.checkpoint_io.integrity import CHECKPOINT_FAILURES
from zerodp.comm import Comm
from zerodp.errors import CheckpointError, CheckpointStorageError

NOTHING_COMMITTED = (
    "nothing was committed: the previous checkpoints and 'latest' are intact, the engine "
    "is unchanged and training can go on"
)


def agreed(comm: Comm, where: str, work: Callable[[], None]) -> None:
    """Run `work` on every rank; any rank's failure is one CheckpointError on all of them."""
    error: BaseException | None = None
    try:
        work()
    except CHECKPOINT_FAILURES as caught:
        error = as_checkpoint_error(caught, where)
    comm.raise_if_any_failed(error)


def as_checkpoint_error(error: BaseException, where: str) -> CheckpointError:
    """`error` as the CheckpointError a user sees: `where` it happened, its root cause (the
    first failing rank's, inside DCP's own exception) and that nothing was committed."""
    if isinstance(error, CheckpointError):
        return error
    cause = root_cause(error)
    rank = _failed_rank(error)
    text = f"{'' if rank is None else f'on rank {rank}, '}{type(cause).__name__}: {cause}"
    if isinstance(cause, OSError):
        return CheckpointStorageError(
            f"{where} failed ({text}); free space or fix the storage, or pass another "
            f"save_dir; {NOTHING_COMMITTED}"
        )
    return CheckpointError(f"{where} failed ({text}); {NOTHING_COMMITTED}")


def _failed_rank(error: BaseException) -> int | None:
    failures = getattr(error, "failures", None)
    return min(failures) if isinstance(failures, dict) and failures else None


def root_cause(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's `CheckpointException`, else `error`."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            return root_cause(inner)
    return error
