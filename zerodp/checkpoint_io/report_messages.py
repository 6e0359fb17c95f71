"""The messages of a decoupled save (`RankReport`, `Verdict`), as JSON for the store.

The store is reachable by every process of the job, and its host listens on a
port: what one reads from it must never run code. So a message is JSON, decoded
into known types only (a pickle would build whatever it names). A report holds
DCP's `WriteResult` of each chunk a rank wrote, which rank 0 needs for
`.metadata`; it is written as its fields (the tensor's key, the chunk's offset
in the file and its length) and built back as DCP's own types.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from zerodp.errors import AGREED_TYPES, CheckpointError


@dataclass(frozen=True)
class RankReport:
    """One rank's part of a save: DCP's write results and the checksum entries of its files,
    or why its part failed."""

    rank: int
    results: list[Any]  # DCP's WriteResult of every chunk this rank wrote
    entries: dict[str, dict[str, Any]]  # checksum entries of the files this rank wrote
    error: CheckpointError | None = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "rank": self.rank,
                "results": [_result_record(result) for result in self.results],
                "entries": self.entries,
                "error": _error_record(self.error),
            }
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> RankReport:
        try:
            value = json.loads(data.decode())
            return cls(
                int(value["rank"]),
                [_result_from(record) for record in value["results"]],
                dict(value["entries"]),
                _error_from(value["error"]),
            )
        except (ValueError, KeyError, TypeError) as caught:  # UnicodeError is a ValueError
            raise CheckpointError(
                f"a rank's report on the save is damaged ({type(caught).__name__}: {caught}); "
                "the save was not committed"
            ) from None


@dataclass(frozen=True)
class Verdict:
    """Rank 0's word on a save, the same on every rank: committed, or the error."""

    error: CheckpointError | None

    def encode(self) -> bytes:
        return json.dumps(_error_record(self.error) or {"error": None}).encode()

    @classmethod
    def decode(cls, data: bytes) -> Verdict:
        value = json.loads(data.decode())
        return cls(_error_from(value if value.get("error") is not None else None))


def _error_record(error: CheckpointError | None) -> dict[str, str] | None:
    if error is None:
        return None
    return {"type": type(error).__name__, "error": str(error)}


def _error_from(record: Any) -> CheckpointError | None:
    """The error a record names, as one of zerodp's agreed types (else a CheckpointError)."""
    if record is None:
        return None
    kind = AGREED_TYPES.get(record.get("type", ""), CheckpointError)
    error = kind(record["error"])
    return error if isinstance(error, CheckpointError) else CheckpointError(str(error))


def _result_record(result: WriteResult) -> dict[str, Any]:
    info, index = result.storage_data, result.index
    if not isinstance(info, _StorageInfo):  # pragma: no cover - FileSystemWriter's only
        raise RuntimeError(f"internal error: a write result stored as {type(info).__name__}")
    return {
        "fqn": index.fqn,
        "offset": None if index.offset is None else list(index.offset),
        "index": index.index,
        "size_in_bytes": result.size_in_bytes,
        "storage": {
            f.name: _listed(getattr(info, f.name)) for f in dataclasses.fields(_StorageInfo)
        },
    }


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _result_from(record: dict[str, Any]) -> WriteResult:
    offset = record["offset"]
    index = MetadataIndex(
        str(record["fqn"]),
        None if offset is None else torch.Size(int(o) for o in offset),
        None if record["index"] is None else int(record["index"]),
    )
    return WriteResult(index, int(record["size_in_bytes"]), _StorageInfo(**record["storage"]))
