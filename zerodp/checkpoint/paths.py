"""Where a checkpoint lives, checked before anything is written, and made visible atomically.

Layout of `save_dir`:

    latest                  the newest tag (written last, by an atomic rename)
    <tag>/                  one checkpoint: DCP's files plus zerodp's JSON files
    .tmp.<tag>.<id>/        a checkpoint being written (never read)

A checkpoint is written under a temporary name and renamed to `<tag>` only
after every rank has finished writing; `latest` is updated after that. A save
killed part-way leaves the previous checkpoint and `latest` as they were.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

from zerodp.errors import CheckpointError, CheckpointPathError, CheckpointStorageError

LATEST = "latest"
TEMP_PREFIX = ".tmp."


def check_save_target(save_dir: object, tag: object) -> Path:
    """Raise CheckpointPathError/CheckpointStorageError naming the fix when `save_dir`/`tag` cannot
    take a checkpoint."""
    directory = _as_directory(save_dir, "save_dir")
    if tag is not None:
        check_tag(tag)
    if directory.exists() and not directory.is_dir():
        raise CheckpointPathError(
            f"save_dir '{directory}' is a file, not a directory; pass a directory path"
        )
    probe_parent = directory if directory.exists() else _first_existing_parent(directory)
    if not probe_parent.is_dir():
        raise CheckpointPathError(
            f"save_dir '{directory}' lies under '{probe_parent}', which is a file; pass a "
            "directory path"
        )
    try:  # a real write: permission bits say nothing for root or read-only mounts
        with tempfile.TemporaryFile(dir=probe_parent):
            pass
    except OSError as error:
        raise CheckpointStorageError(
            f"cannot write checkpoints under '{directory}' ('{probe_parent}' is not writable: "
            f"{error.strerror}); pass a directory you can write to"
        ) from None
    return directory


def has_latest(load_dir: object) -> bool:
    """Whether `load_dir` names a newest checkpoint (DeepSpeed loads nothing when it does not)."""
    directory = _as_directory(load_dir, "load_dir")
    return (directory / LATEST).is_file()


def check_load_source(load_dir: object, tag: object) -> tuple[Path, str]:
    """The checkpoint directory to load and its tag (read from `latest` when tag is None)."""
    directory = _as_directory(load_dir, "load_dir")
    if not directory.is_dir():
        raise CheckpointStorageError(
            f"load_dir '{directory}' does not exist or is not a directory; pass the directory "
            "given to save_checkpoint"
        )
    if tag is None:
        latest = directory / LATEST
        if not latest.is_file():
            raise CheckpointError(
                f"no checkpoint in '{directory}' (no '{LATEST}' file); pass tag= or the "
                "directory given to save_checkpoint"
            )
        tag = latest.read_text().strip()
    tag_text = check_tag(tag)
    path = directory / tag_text
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist; check the tag")
    return path, tag_text


def check_tag(tag: object) -> str:
    if not isinstance(tag, str) or not tag.strip():
        raise CheckpointPathError(f"checkpoint tag must be a non-empty string, got {tag!r}")
    if "/" in tag or "\\" in tag or os.sep in tag or tag in (".", "..") or tag == LATEST:
        raise CheckpointPathError(
            f"checkpoint tag {tag!r} must be a plain name (no path separators, not "
            f"'.', '..' or '{LATEST}'); e.g. 'global_step100'"
        )
    if tag.startswith(TEMP_PREFIX):
        raise CheckpointPathError(f"checkpoint tag {tag!r} may not start with '{TEMP_PREFIX}'")
    return tag


def new_temp_name(tag: str) -> str:
    return f"{TEMP_PREFIX}{tag}.{uuid.uuid4().hex[:12]}"


def commit(directory: Path, temp_name: str, tag: str) -> Path:
    """Make a fully written checkpoint visible (rank 0 only, after every rank wrote)."""
    final = directory / tag
    temp = directory / temp_name
    displaced = None
    if final.exists():
        displaced = directory / f"{TEMP_PREFIX}old.{temp_name}"
        final.rename(displaced)
    temp.rename(final)
    write_latest(directory, tag)
    if displaced is not None:
        shutil.rmtree(displaced, ignore_errors=True)
    return final


def write_latest(directory: Path, tag: str) -> None:
    handle, staging = tempfile.mkstemp(dir=directory, prefix=f"{TEMP_PREFIX}{LATEST}.")
    with os.fdopen(handle, "w") as file:
        file.write(tag)
        file.flush()
        os.fsync(file.fileno())
    os.replace(staging, directory / LATEST)


def _as_directory(value: object, name: str) -> Path:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise CheckpointPathError(f"{name} must be a directory path, got {value!r}")
    if not isinstance(value, (str, os.PathLike)):
        raise CheckpointPathError(
            f"{name} must be a str or os.PathLike, got {type(value).__name__}"
        )
    return Path(value)


def _first_existing_parent(path: Path) -> Path:
    for parent in [path, *path.absolute().parents]:
        if parent.exists():
            return parent
    return Path("/")
