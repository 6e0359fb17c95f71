"""Write a safetensors file one tensor at a time, without holding them all.

The safetensors format is a JSON header (every tensor's name, dtype, shape and
byte range) followed by the tensors' bytes in that order. Everything the
header needs is known before any value is: so the header is written first
and each tensor's bytes are appended as it arrives, and the writer never
holds more than the tensor it is given. Files are written under a temporary
name and renamed when complete, so a reader never sees a half-written file.
`plan_files` and `write_index` give a directory Hugging Face's layout
(`model.safetensors`, or numbered shards and `model.safetensors.index.json`).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


class SafetensorsStreamWriter:
    """`with SafetensorsStreamWriter(path, entries) as w: w.write(name, tensor)` in entry order."""

    def __init__(
        self, path: Path, entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None
    ) -> None:
        for entry in entries:
            if entry.dtype not in _DTYPES:
                raise TypeError(f"safetensors cannot store '{entry.name}' of dtype {entry.dtype}")
        self.path = path
        self.entries = list(entries)
        self._next = 0
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for entry in self.entries:
            header[entry.name] = {
                "dtype": _DTYPES[entry.dtype],
                "shape": list(entry.shape),
                "data_offsets": [offset, offset + entry.nbytes],
            }
            offset += entry.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        self._header = text + b" " * (-len(text) % 8)  # keep the data 8-byte aligned
        self._temp = path.with_name(f".{path.name}.partial")
        self._file: BinaryIO | None = None

    def __enter__(self) -> SafetensorsStreamWriter:
        file = self._temp.open("wb")
        file.write(struct.pack("<Q", len(self._header)))
        file.write(self._header)
        self._file = file
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor (it must be the next entry, with its dtype and shape)."""
        if self._file is None:
            raise RuntimeError("internal error: SafetensorsStreamWriter used outside `with`")
        entry = self.entries[self._next]
        if name != entry.name or tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ValueError(
                f"safetensors stream: expected '{entry.name}' {entry.dtype} {entry.shape}, got "
                f"'{name}' {tensor.dtype} {tuple(tensor.shape)}"
            )
        # A copy: numpy must not share the storage of a parameter zerodp frees and refills
        # (numpy pins a storage's size), and the bytes are written from the copy.
        flat = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1)
        self._file.write(flat.view(torch.uint8).numpy().data)  # the buffer, not a bytes copy
        self._next += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if exc_type is None and self._next != len(self.entries):
            missing = [e.name for e in self.entries[self._next :]]
            self._temp.unlink(missing_ok=True)
            raise RuntimeError(f"internal error: safetensors stream ended before {missing[:3]}")
        if exc_type is not None:
            self._temp.unlink(missing_ok=True)
            return
        os.replace(self._temp, self.path)


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def plan_files(
    path: Path, entries: list[TensorEntry], max_shard_bytes: int | None
) -> list[tuple[Path, list[TensorEntry]]]:
    """Which file each entry goes to: `path` itself when it ends in `.safetensors`, else
    Hugging Face's layout in directory `path`, shards of at most `max_shard_bytes`."""
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        return [(path, entries)]
    path.mkdir(parents=True, exist_ok=True)
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if max_shard_bytes is not None and shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    if len(shards) == 1:
        return [(path / SINGLE_FILE, shards[0])]
    count = len(shards)
    return [
        (path / f"model-{i + 1:05d}-of-{count:05d}.safetensors", shard)
        for i, shard in enumerate(shards)
    ]


def write_index(path: Path, files: list[tuple[Path, list[TensorEntry]]]) -> None:
    """Hugging Face's `model.safetensors.index.json` for sharded `files` (none for one file)."""
    if len(files) < 2:
        return
    weight_map = {e.name: f.name for f, file_entries in files for e in file_entries}
    total = sum(e.nbytes for _, file_entries in files for e in file_entries)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
