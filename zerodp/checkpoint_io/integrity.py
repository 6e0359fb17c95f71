"""Checks made before loading: the right model, complete files, known keys.

Each check is local (every rank reads the same files and reaches the same
verdict), and its result is agreed on by all ranks before any collective, so
a bad checkpoint is an error with a message on every rank, never a crash
inside DCP's collectives.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from zerodp.checkpoint_io.safe_metadata import read_metadata
from zerodp.errors import CheckpointError

# What DCP raises: `CheckpointException` derives from BaseException, so `except Exception`
# alone would let it escape past every agreement point.
try:
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover - older torch
    CheckpointException = Exception  # type: ignore[assignment,misc]

CHECKPOINT_FAILURES = (Exception, CheckpointException)

__all__ = ["check_files", "check_model", "read_metadata", "saved_keys"]


def check_files(path: Path, metadata: Metadata) -> None:
    """Every data file the metadata refers to exists and is long enough."""
    needed: dict[str, int] = {}
    storage = metadata.storage_data or {}
    for info in storage.values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size < size:
            problems.append(f"{name} is truncated ({file.stat().st_size} of {size} bytes)")
    if problems:
        raise CheckpointError(f"checkpoint '{path}' is incomplete: " + "; ".join(problems))


def check_model(current: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint is for this model: the same parameter names and whole shapes (a
    tensor-parallel slice counted as the weight it is cut from)."""
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    mismatched = [
        f"{name}: checkpoint {list(saved[name])} vs model {list(shape)}"
        for name, shape in current.items()
        if name in saved and tuple(saved[name]) != tuple(shape)
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append("missing in the checkpoint: " + ", ".join(missing))
        if unexpected:
            parts.append("unexpected (not in the model): " + ", ".join(unexpected))
        if mismatched:
            parts.append("shape mismatches: " + "; ".join(mismatched))
        raise CheckpointError("the checkpoint is for a different model: " + " | ".join(parts))


def saved_keys(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    return {
        key: value
        for key, value in metadata.state_dict_metadata.items()
        if isinstance(value, TensorStorageMetadata)
    }
