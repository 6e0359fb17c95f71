"""Which engine manages a parameter, for the `zerodp.utils` and `zerodp.zero` functions."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from zerodp.engine import ZeroEngine

_ENGINES: dict[int, weakref.ref[ZeroEngine]] = {}


def register(engine: ZeroEngine, params: list[nn.Parameter]) -> None:
    ref = weakref.ref(engine)
    for param in params:
        _ENGINES[id(param)] = ref


def unregister(params: list[nn.Parameter]) -> None:
    for param in params:
        _ENGINES.pop(id(param), None)


def engine_of(param: nn.Parameter) -> ZeroEngine | None:
    ref = _ENGINES.get(id(param))
    return ref() if ref is not None else None
