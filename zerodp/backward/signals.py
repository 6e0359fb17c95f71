"""A typed list of callbacks with removable handles: the one way zerodp announces events.

The backward lifecycle announces prologues, epilogues and aborts with it; the
reducer announces that a group's contributions are complete.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from torch.utils.hooks import RemovableHandle

T = TypeVar("T")


class Signal(Generic[T]):
    """Callbacks taking one argument, run in registration order."""

    def __init__(self) -> None:
        # RemovableHandle keeps a weak reference to this dict: OrderedDict allows one.
        self._callbacks: OrderedDict[int, Callable[[T], None]] = OrderedDict()

    def connect(self, callback: Callable[[T], None]) -> RemovableHandle:
        handle = RemovableHandle(self._callbacks)
        self._callbacks[handle.id] = callback
        return handle

    def emit(self, value: T) -> None:
        """Run every callback, even when one raises; then re-raise the first error."""
        first_error: BaseException | None = None
        for callback in list(self._callbacks.values()):
            try:
                callback(value)
            except BaseException as error:
                if first_error is None:
                    first_error = error
        if first_error is not None:
            raise first_error
