"""A byte-level text corpus that every Python installation already has: its own standard library.

The demo must run with no network and no downloads, yet train on real text
whose loss curve means something. The `*.py` sources of the standard library
are a few tens of megabytes of varied, well-formed code, present wherever the
interpreter is. Everything here is deterministic (sorted paths, a seeded file
order), so every rank builds the same datasets without communicating.
"""

from __future__ import annotations

import os
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

# Third-party code lives under the stdlib folder on many installs; it is not the stdlib.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
FILE_SEPARATOR = b"\n\n"


def stdlib_root() -> Path:
    """The folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path) -> list[Path]:
    """Every `*.py` file under `root` except third-party folders, sorted for determinism."""
    files: list[Path] = []
    for folder, subdirs, names in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages, often the bigger tree.
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_by_file(files: Sequence[Path], every: int) -> tuple[list[Path], list[Path]]:
    """Every `every`-th file to validation, the rest to training.

    Splitting by file rather than by window keeps near-duplicate text (the
    same file's neighbouring windows) out of both sides, so the validation
    loss measures generalisation, not memorisation.
    """
    train = [f for i, f in enumerate(files) if i % every != every - 1]
    valid = [f for i, f in enumerate(files) if i % every == every - 1]
    return train, valid


def read_capped(files: Sequence[Path], max_bytes: int, seed: int) -> bytes:
    """The files' bytes, in a seeded shuffled order, joined and cut at `max_bytes`.

    Shuffling (deterministically) before capping samples files from the whole
    library; reading in sorted order would give a corpus of `a*` modules.
    Files are read only until the cap is reached, so start-up stays fast.
    """
    order = list(files)
    random.Random(seed).shuffle(order)
    parts: list[bytes] = []
    total = 0
    for path in order:
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:  # an unreadable file (permissions, a broken link) is just skipped
            continue
        parts.append(data + FILE_SEPARATOR)
        total += len(parts[-1])
    return b"".join(parts)[:max_bytes]


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed-length windows of a byte string: item i is (input, target), targets shifted by one.

    Windows start every `stride` bytes and are `seq_len + 1` bytes long. The
    bytes are kept once as a uint8 tensor; an item is a slice, converted to
    int64 only when fetched, so memory stays at one byte per byte of text.
    """

    def __init__(self, data: bytes, seq_len: int, stride: int | None = None) -> None:
        if len(data) < seq_len + 1:
            raise ValueError(
                f"the corpus has {len(data)} bytes, fewer than one window of {seq_len + 1}; "
                "lower --seq-len or raise the byte cap"
            )
        self._buffer = bytearray(data)  # the tensor below views it, so keep it alive
        self.data = torch.frombuffer(self._buffer, dtype=torch.uint8)
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self._count = (len(data) - seq_len - 1) // self.stride + 1

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self._count:
            raise IndexError(f"window {index} is out of range (0..{self._count - 1})")
        start = index * self.stride
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


@dataclass(frozen=True)
class Corpus:
    """The train and validation windows, and how many files and bytes went into each."""

    train: ByteWindows
    valid: ByteWindows
    train_files: int
    valid_files: int

    @property
    def train_bytes(self) -> int:
        return len(self.train.data)

    @property
    def valid_bytes(self) -> int:
        return len(self.valid.data)


def load_corpus(
    seq_len: int,
    *,
    max_train_bytes: int,
    max_valid_bytes: int,
    valid_every: int = 20,
    seed: int = 0,
    root: Path | None = None,
) -> Corpus:
    """Build the stdlib corpus: split by file, read under the byte caps, cut into windows."""
    files = python_files(root or stdlib_root())
    if len(files) < valid_every:
        raise FileNotFoundError(
            f"found only {len(files)} .py files under {root or stdlib_root()}; "
            "the demo needs the Python standard library sources"
        )
    train_files, valid_files = split_by_file(files, valid_every)
    train = ByteWindows(read_capped(train_files, max_train_bytes, seed), seq_len)
    valid = ByteWindows(read_capped(valid_files, max_valid_bytes, seed), seq_len)
    return Corpus(train, valid, len(train_files), len(valid_files))
