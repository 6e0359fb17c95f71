"""Read DeepSpeed's pickled files without running any code from them.

DeepSpeed writes its checkpoints with `torch.save`: pickles of dicts, lists,
tensors and numbers, plus three small objects of its own classes (a loss
scaler, the ZeRO stage enum, and a fragment address). A pickle can name any
callable to run while it is read, so these files are read with torch's
restricted unpickler (`torch.load(weights_only=True)`), which builds tensors
and containers and refuses every other global. DeepSpeed's own classes are
allowed under their names, but what is built is zerodp's plain record of the
fields (`DeepSpeedRecord`), never DeepSpeed's class: nothing DeepSpeed
ships is imported, and a file that names anything else (a planted
`__reduce__` calling `os.system`, a user's own class in the client state) is
refused with a `CheckpointError` before any of it runs.

Files are memory-mapped where torch allows it (the zip format every torch
since 1.6 writes), so a tensor's bytes are read only when they are copied.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zerodp.errors import CheckpointError

_RECORD = "DeepSpeed record:"  # how a record's own refusals start
# Plain values a DeepSpeed record may hold (its fields are numbers, flags and dtypes).
_FIELD_TYPES = (bool, int, float, str, type(None), torch.dtype)


class DeepSpeedRecord:
    """The fields of one pickled DeepSpeed object, kept as a dict; no behaviour of its own.

    torch's restricted unpickler makes it with `__new__` and hands it the
    pickled fields through `__setstate__`; only plain values are accepted.
    """

    kind = "DeepSpeed object"
    fields: dict[str, Any]

    def __new__(cls, *args: Any) -> DeepSpeedRecord:
        record = super().__new__(cls)
        record.fields = {}
        return record

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (None, slots): the pickle of an object with __slots__
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{_RECORD} a {self.kind} whose fields are not a dict")
        fields = {}
        for key, value in state.items():
            if not isinstance(key, str) or not isinstance(value, _FIELD_TYPES):
                raise pickle.UnpicklingError(
                    f"{_RECORD} {self.kind} field {key!r} holds a {type(value).__name__}, not a "
                    "plain value"
                )
            fields[key] = value
        self.fields = fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def __repr__(self) -> str:
        return f"{self.kind}({self.fields})"


class StaticLossScalerRecord(DeepSpeedRecord):
    kind = "LossScaler"


class DynamicLossScalerRecord(DeepSpeedRecord):
    kind = "DynamicLossScaler"


class FragmentAddressRecord(DeepSpeedRecord):
    kind = "fragment_address"


class ZeroStage(int):
    """DeepSpeed's `ZeroStageEnum`, pickled as the enum class called with its value."""

    def __new__(cls, value: Any) -> ZeroStage:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 3:
            raise pickle.UnpicklingError(f"{_RECORD} a ZeRO stage of {value!r}")
        return super().__new__(cls, value)


# DeepSpeed's names for the objects above: the whole allow-list beyond torch's own.
ALLOWED: dict[str, type] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": StaticLossScalerRecord,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScalerRecord,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddressRecord,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
}

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def read_pickle(path: Path) -> Any:
    """The object pickled in DeepSpeed file `path`, read without running code from it.

    Raises `CheckpointError` naming the file for a missing, damaged or refused file.
    """
    if not path.is_file():
        raise CheckpointError(f"'{path}' is missing; the DeepSpeed checkpoint is incomplete")
    allow: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        (cls, name) for name, cls in ALLOWED.items()
    ]
    try:
        with torch.serialization.safe_globals(allow):
            return torch.load(
                path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
            )
    except pickle.UnpicklingError as error:
        raise _refused(path, error) from None
    except (OSError, RuntimeError, ValueError, EOFError, KeyError) as error:
        raise CheckpointError(
            f"'{path}' could not be read ({type(error).__name__}: {error}); the file is damaged "
            "or is not a torch.save file"
        ) from None


def _refused(path: Path, error: pickle.UnpicklingError) -> CheckpointError:
    text = str(error)
    if _RECORD in text:
        detail = text[text.index(_RECORD) + len(_RECORD) :].strip().splitlines()[0]
        return CheckpointError(
            f"'{path}' was refused: {detail}; zerodp keeps only plain values of DeepSpeed's own "
            "objects, and this one is damaged or was tampered with"
        )
    found = _GLOBAL.search(text)
    what = f"'{found.group(1)}'" if found else "an object zerodp does not read"
    return CheckpointError(
        f"'{path}' was refused: it asks to build {what}, and zerodp reads DeepSpeed "
        "checkpoints without running code from them (tensors, containers, numbers and "
        "DeepSpeed's loss scaler, stage and fragment records only). If the object is part of "
        "your client_state, save it as plain data (numbers, strings, lists, dicts, tensors); "
        "if you did not put it there, the file may have been tampered with: do not load it "
        "with torch.load(weights_only=False) either"
    )
