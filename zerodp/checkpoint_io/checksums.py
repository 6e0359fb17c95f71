"""A checksum per tensor chunk and per small file, written at save and checked at load.

`checksums.json` (written last, by rank 0, before the commit) lists every
file of the checkpoint with its size; each DCP data file also lists the
checksum of every chunk DCP stored in it (one chunk is one rank's part of
one tensor), so a mismatch names the file and the tensor. The small files
(`.metadata`, `zerodp_state.json`, `rank<r>.json`) get one checksum each and
are checked by every rank that reads them, before reading them; the data
files are split over the ranks (file i on rank i mod world size), so each
byte is hashed once per save and once per load. Every verdict is local
and the load agrees on it before anything changes.

The checksum is xxHash's XXH3 (64 bits, the `xxhash` package): several times
faster than zlib's CRC32 on one core (`python bench/checkpoint_io.py
--hash-speed` prints both), which kept verification under 10% of a load's
time (bench/checkpoint_io.py). It catches flipped bits, torn writes
and truncation; it is no defence against someone who rewrites the files on
purpose (nothing in a checkpoint is executed, see `safe_metadata`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import Metadata

from zerodp.checkpoint_io.paths import CHECKSUM_FILE, write_file_synced
from zerodp.errors import CheckpointError

ALGORITHM = "xxh3_64"
_BLOCK = 16 * 2**20


def hash_of_file(file: Path) -> tuple[int, int]:
    """(size, checksum) of a whole file."""
    hasher, size = xxhash.xxh3_64(), 0
    with file.open("rb") as handle:
        while block := handle.read(_BLOCK):
            hasher.update(block)
            size += len(block)
    return size, hasher.intdigest()


def chunks_by_file(metadata: Metadata) -> dict[str, list[tuple[int, int, str]]]:
    """For each data file, its chunks as (offset, length, tensor key), in file order."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        out.setdefault(info.relative_path, []).append(
            (int(info.offset), int(info.length), index.fqn)
        )
    for chunks in out.values():
        chunks.sort()
    return out


def my_share(names: Iterable[str], rank: int, world_size: int) -> list[str]:
    """The files this rank hashes: every world_size-th one, in sorted order."""
    return [name for i, name in enumerate(sorted(names)) if i % world_size == rank]


def data_file_entry(file: Path, chunks: list[tuple[int, int, str]]) -> dict[str, Any]:
    """Size and per-chunk checksum of one data file (read once, sequentially)."""
    digests = []
    with file.open("rb") as handle:
        for offset, length, _key in chunks:
            handle.seek(offset)
            digests.append(_hash_of_range(handle, length))
    listed = [[o, n, c] for (o, n, _), c in zip(chunks, digests, strict=True)]
    return {"size": file.stat().st_size, "chunks": listed}


def small_file_entry(file: Path) -> dict[str, Any]:
    size, digest = hash_of_file(file)
    return {"size": size, "hash": digest}


def write_manifest(path: Path, files: dict[str, dict[str, Any]]) -> None:
    body = {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    write_file_synced(path / CHECKSUM_FILE, json.dumps(body, indent=0).encode())


def read_manifest(path: Path) -> dict[str, dict[str, Any]] | None:
    """The checksum list, or None for a checkpoint written before checksums existed."""
    file = path / CHECKSUM_FILE
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"'{file}' is unreadable or corrupted: {error}") from None
    files = data.get("files") if isinstance(data, dict) else None
    if data.get("algorithm") != ALGORITHM or not isinstance(files, dict):
        raise CheckpointError(f"'{file}' is not a zerodp checksum list; it is damaged")
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
            raise CheckpointError(f"'{file}': the entry for '{name}' is damaged")
    return files


def check_small_file(path: Path, name: str, files: dict[str, dict[str, Any]]) -> None:
    """The file `name` is there and has the size and checksum it was saved with."""
    entry = files.get(name)
    file = path / name
    if entry is None:
        raise CheckpointError(f"'{file}' is not in {CHECKSUM_FILE}; the checkpoint is damaged")
    if not file.is_file():
        raise CheckpointError(f"'{file}' is missing; the checkpoint is incomplete")
    size, digest = hash_of_file(file)
    if size != entry["size"] or digest != entry.get("hash"):
        raise CheckpointError(
            f"'{file}' is corrupted: its checksum does not match the one saved "
            f"({size} bytes, expected {entry['size']}); restore it from a good copy, or load "
            "an earlier checkpoint"
        )


def check_data_file(
    path: Path, name: str, chunks: list[tuple[int, int, str]], files: dict[str, dict[str, Any]]
) -> None:
    """Every chunk of data file `name` has the checksum it was saved with."""
    entry = files.get(name)
    file = path / name
    if entry is None or not isinstance(entry.get("chunks"), list):
        raise CheckpointError(f"'{file}' is not in {CHECKSUM_FILE}; the checkpoint is damaged")
    saved = {(int(o), int(n)): c for o, n, c in entry["chunks"]}
    if file.stat().st_size != entry["size"]:
        raise CheckpointError(
            f"'{file}' has {file.stat().st_size} bytes, {entry['size']} were saved: the file "
            "is truncated or was changed; restore it from a good copy"
        )
    with file.open("rb") as handle:
        for offset, length, key in chunks:
            expected = saved.get((offset, length))
            handle.seek(offset)
            if expected is None or _hash_of_range(handle, length) != expected:
                raise CheckpointError(
                    f"'{file}' is corrupted: the checksum of tensor '{key}' (bytes {offset} to "
                    f"{offset + length}) does not match the one saved; nothing was loaded; "
                    "restore the file from a good copy, or load an earlier checkpoint"
                )


def _hash_of_range(handle: Any, length: int) -> int:
    hasher = xxhash.xxh3_64()
    left = length
    while left > 0:
        block = handle.read(min(left, _BLOCK))
        if not block:
            return -1  # shorter than recorded
        hasher.update(block)
        left -= len(block)
    return hasher.intdigest()
