"""Where a checkpoint lives, checked before anything is written, and made visible atomically.

Layout of `save_dir`:

    latest                  the newest tag (written last, by an atomic rename)
    <tag>/                  one checkpoint: DCP's files plus zerodp's JSON files
    .tmp.<tag>.<id>/        a checkpoint being written (never read)

A checkpoint is written under a temporary name and made `<tag>` only after
every rank has finished writing and its checksums are written; `latest` is
updated after that (see [Note: atomic commit]). A save killed at any point
leaves every earlier checkpoint and `latest` loadable; its temporary
entries are removed by the next save (`clean_leftovers`).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zerodp.errors import CheckpointError, CheckpointPathError, CheckpointStorageError

LATEST = "latest"
# The file a checkpoint is complete with: every rank's checksums (`zerodp.checkpoint_io.checksums`
# writes it, last); named here, with the folder's other rules, so the commit can look for it.
CHECKSUM_FILE = "checksums.json"
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
        try:
            tag = latest.read_text(encoding="utf-8").strip()
            check_tag(tag)
        except (UnicodeDecodeError, CheckpointPathError) as error:
            raise CheckpointError(
                f"'{latest}' does not name a checkpoint tag ({error}); it is damaged: write "
                "the tag of the checkpoint to resume into it, or pass tag="
            ) from None
    tag_text = check_tag(tag)
    path = resolve_tag(directory, tag_text)
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


def is_our_leftover(name: str) -> bool:
    """Whether `name` is a temporary entry a zerodp save makes (a save's directory, a
    displaced old checkpoint, a staged `latest`), as opposed to anything else in save_dir."""
    if not name.startswith(TEMP_PREFIX):
        return False
    if name.startswith(f"{TEMP_PREFIX}{LATEST}."):
        return True
    return _TEMP_NAME.fullmatch(name) is not None


_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"(old\.)?.+\.[0-9a-f]{12}")


def _step(name: str) -> None:
    """A point of the commit protocol; tests replace `on_commit_step` to die exactly here."""
    on_commit_step(name)


def _no_fault(name: str) -> None:
    return None


on_commit_step: Callable[[str], None] = _no_fault
COMMIT_STEPS = (
    "written",
    "swapped",
    "displaced",
    "renamed",
    "latest_staged",
    "latest_replaced",
    "old_removed",
)


def commit(directory: Path, temp_name: str, tag: str) -> Path:
    """Make a fully written checkpoint visible (rank 0 only, after every rank wrote).

    [Note: atomic commit]
    At every instant `latest` names a complete checkpoint, and so does every
    tag that existed before. A new tag is one rename of the finished
    temporary directory. An existing tag is replaced by swapping the two
    directories in one atomic exchange (`renameat2(RENAME_EXCHANGE)`), so the
    name never points at nothing; the old contents, now under the temporary
    name, are removed afterwards. Where the file system cannot exchange,
    the old directory is renamed aside first and `resolve_tag` finds the new
    one (complete: its checksum list is written last) until the next save
    renames it into place. `latest` is replaced last, by an atomic rename of
    a fully written and fsynced file, and every directory is fsynced after
    its entries change.
    """
    final = directory / tag
    temp = directory / temp_name
    fsync_directory(temp)
    _step("written")
    if final.exists():
        if _exchange(temp, final):
            _step("swapped")
        else:
            displaced = directory / f"{TEMP_PREFIX}old.{temp_name.removeprefix(TEMP_PREFIX)}"
            final.rename(displaced)
            _step("displaced")  # `tag` is missing now: resolve_tag finds the new copy
            temp.rename(final)
            temp = displaced
            _step("renamed")
        fsync_directory(directory)
        write_latest(directory, tag)
        shutil.rmtree(temp, ignore_errors=True)
    else:
        temp.rename(final)
        fsync_directory(directory)
        _step("renamed")
        write_latest(directory, tag)
    fsync_directory(directory)
    _step("old_removed")
    return final


def write_latest(directory: Path, tag: str) -> None:
    handle, staging = tempfile.mkstemp(dir=directory, prefix=f"{TEMP_PREFIX}{LATEST}.")
    os.close(handle)
    write_file_synced(Path(staging), tag.encode())
    _step("latest_staged")
    os.replace(staging, directory / LATEST)
    fsync_directory(directory)
    _step("latest_replaced")


def write_file_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it (its directory is fsynced at the commit)."""
    with path.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def fsync_directory(path: Path) -> None:
    """Make the directory's entries (renames, new files) durable."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms that cannot open directories
        return
    try:
        os.fsync(handle)
    except OSError:  # pragma: no cover - file systems that refuse fsync on directories
        pass
    finally:
        os.close(handle)


def resolve_tag(directory: Path, tag: str) -> Path:
    """The directory holding checkpoint `tag`: `<tag>`, or, after a commit cut short on a
    file system without exchange, its complete new copy still under a temporary name."""
    final = directory / tag
    if final.is_dir():
        return final
    for candidate in _complete_temporaries(directory, tag):
        return candidate
    return final


def clean_leftovers(directory: Path, keep: str | None = None) -> list[str]:
    """Remove what earlier saves left behind (only zerodp's own temporary names, never
    `keep`), after putting back any tag whose commit was cut short; returns what it removed."""
    if not directory.is_dir():
        return []
    displaced_prefix = f"{TEMP_PREFIX}old."
    for entry in sorted(directory.iterdir()):
        if not entry.name.startswith(displaced_prefix) or not is_our_leftover(entry.name):
            continue
        tag = entry.name.removeprefix(displaced_prefix).rsplit(".", 1)[0]
        candidates = _complete_temporaries(directory, tag)
        if not (directory / tag).exists() and candidates:
            candidates[0].rename(directory / tag)
            fsync_directory(directory)
    removed = []
    for entry in sorted(directory.iterdir()):
        if entry.name == keep or not is_our_leftover(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
    if removed:
        fsync_directory(directory)
    return removed


def _complete_temporaries(directory: Path, tag: str) -> list[Path]:
    """The copies of `tag` a commit cut short left (see [Note: atomic commit]): only where
    the old directory was renamed aside, the new one first, each only when complete."""
    found = []
    prefix = f"{TEMP_PREFIX}old.{tag}."
    for displaced in sorted(directory.glob(f"{glob.escape(prefix)}*")):
        if not _TEMP_NAME.fullmatch(displaced.name):
            continue
        new = directory / f"{TEMP_PREFIX}{displaced.name.removeprefix(TEMP_PREFIX + 'old.')}"
        found += [d for d in (new, displaced) if (d / CHECKSUM_FILE).is_file()]
    return found


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux renameat2); False where unsupported."""
    rename = _renameat2()
    if rename is None:
        return False
    result = rename(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(error, os.strerror(error), str(b))


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _renameat2() -> Any:
    if not sys.platform.startswith("linux") or _Exchange.disabled:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.renameat2
    except (OSError, AttributeError):  # pragma: no cover - libc without renameat2
        return None


class _Exchange:
    disabled = False  # tests set it to take the path of file systems without exchange


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
