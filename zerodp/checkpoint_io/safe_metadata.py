"""DCP's `.metadata` read without running code: an allowlisting unpickler, then a shape check.

DCP stores its metadata as a pickle, and `pickle.load` calls whatever a file
names (a planted `__reduce__` runs at load). zerodp never calls it: the
unpickler below resolves only DCP's own metadata classes and the few torch
and pathlib values they hold (dtypes, layouts, `torch.Size`, paths); any
other global is refused before anything is called. What comes out is then
checked field by field (types, plain relative file names, no stream
transforms), so a damaged or hostile file is a `CheckpointError` naming it.
`SafeReader` is the `FileSystemReader` DCP gets: it hands DCP this checked
metadata instead of unpickling the file itself, and names the file any read
failed on.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from zerodp.errors import CheckpointError

METADATA_FILE = ".metadata"

_DCP_CLASSES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in _DCP_CLASSES
        if hasattr(dcp_metadata, name)
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    **{
        ("pathlib", name): getattr(pathlib, name)
        for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    },
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)  # a dtype, layout or memory format: a value, not code
        raise pickle.UnpicklingError(f"refused global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id")


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The checked DCP metadata of checkpoint directory `path`; nothing in it is executed."""
    file = path / METADATA_FILE
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"'{path}' has no DCP metadata ({METADATA_FILE}): the save did not finish or the "
            "checkpoint was truncated"
        ) from None
    except OSError as error:
        raise CheckpointError(f"'{file}' is unreadable: {error.strerror or error}") from None
    try:
        metadata = _AllowlistUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # any malformed pickle: refused, never executed
        raise CheckpointError(
            f"'{file}' is not DCP metadata zerodp can read safely ({error}); the file is "
            "damaged or was replaced; restore it from a good copy of the checkpoint"
        ) from None
    problem = _shape_problem(metadata)
    if problem is not None:
        raise CheckpointError(f"'{file}' is malformed DCP metadata: {problem}")
    return metadata


def _shape_problem(metadata: Any) -> str | None:  # noqa: PLR0911 - one return per check
    if not isinstance(metadata, dcp_metadata.Metadata):
        return f"a {type(metadata).__name__}, not a Metadata"
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        return "state_dict_metadata is not a dict"
    for key, entry in entries.items():
        if not isinstance(key, str):
            return f"key {key!r} is not a string"
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            if not isinstance(entry.size, torch.Size) or not isinstance(
                getattr(entry.properties, "dtype", None), torch.dtype
            ):
                return f"'{key}' has no valid size or dtype"
        elif not isinstance(entry, dcp_metadata.BytesStorageMetadata):
            return f"'{key}' is a {type(entry).__name__}"
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "storage_data is not a dict"
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(
            info, dcp_filesystem._StorageInfo
        ):
            return "storage_data holds an unexpected entry"
        name = info.relative_path
        if not isinstance(name, str) or not name or name != os.path.basename(name):
            return f"data file name {name!r} is not a plain file name"
        if name.startswith("."):
            return f"data file name {name!r} is not a plain file name"
        for number in (info.offset, info.length):
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                return f"'{index.fqn}' has an invalid offset or length"
        if getattr(info, "transform_descriptors", None):
            return f"'{index.fqn}' asks for stream transforms, which zerodp never writes"
    return None


class _NamingFileSystem(dcp_filesystem.FileSystem):
    """DCP's file system, but a failure while a file is open names that file."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as error:
            raise CheckpointError(f"reading '{path}' failed: {error}") from error


class SafeReader(FileSystemReader):
    """A `FileSystemReader` that hands DCP metadata checked by zerodp (never `pickle.load`)."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(str(path))
        self.fs = _NamingFileSystem()
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = self._checked
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
