"""Deprecation warnings that zerodp's own code causes, told apart by the stack they are raised on.

A warning is attributed to the frame its `stacklevel` names. torch's deprecated
collectives name torch's own logging wrapper around them, and transformers' deprecated
methods name themselves, so a filter on the module `zerodp.*` misses a warning that a
library raises because zerodp called it. This looks at the stack while the warning is
shown: the frame that called the deprecated function decides (`zerodp_caller`).
zerodp's package (but for this test harness) and, in a source checkout, the repository's
`examples/` are zerodp's; a test, a user's script or a library calling its own deprecated
API is not.

Used by the test pool's workers (`zerodp.testing.dist`), which fail a task that caused
one, and by the tests' conftest for the tests that run in pytest's own process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import site
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import typing_extensions

DEPRECATIONS: tuple[type[Warning], ...] = (DeprecationWarning, FutureWarning)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
_HARNESS = os.path.join(_PACKAGE, "testing")
_EXAMPLES = os.path.join(os.path.dirname(_PACKAGE), "examples")
_LIBRARIES = tuple(
    {
        os.path.realpath(path)
        for path in (
            *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")),
            *site.getsitepackages(),
        )
    }
)
# Frames of the warning's display and of deprecation decorators (`typing_extensions.deprecated`,
# which torch uses; `warnings.deprecated` is in `warnings` itself).
_MACHINERY = frozenset(
    os.path.realpath(module.__file__)
    for module in (warnings, sys.modules[__name__], typing_extensions)
    if module.__file__ is not None
)
# With `show_all`, the warnings zerodp did not cause that this process has shown already.
_SHOWN: set[tuple[Any, ...]] = set()


@dataclass(frozen=True)
class CausedWarning:
    """A deprecation warning and the line of zerodp whose call led to it."""

    category: str
    message: str
    caller: str  # path (under the repository) and line of the zerodp frame

    def __str__(self) -> str:
        return f"{self.category} caused by {self.caller}: {self.message}"


@functools.lru_cache(maxsize=4096)
def _real(path: str) -> str:
    return path if path.startswith("<") else os.path.realpath(path)


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder + os.sep)


def _is_zerodp(path: str) -> bool:
    if _under(path, _PACKAGE):
        return not _under(path, _HARNESS)
    return _under(path, _EXAMPLES)


def _is_library(path: str) -> bool:
    """The standard library's or an installed package's (zerodp's own is asked first)."""
    return any(_under(path, root) for root in _LIBRARIES)


def zerodp_caller(frame: FrameType | None, filename: str, lineno: int) -> str | None:
    """The line of zerodp whose call raised the warning shown from `frame`, if any.

    `frame` is a frame of the warning's display (inside `warnings`); `filename` and
    `lineno` are where the warning is attributed. Attributed to zerodp: zerodp's. To other
    code that is not a library's (a test, a script): that code's. To the library function
    that raised it (`warnings.warn` without a stacklevel, as transformers' deprecated
    methods do; a deprecation decorator counts as part of the function it decorates, so
    torch's collectives, attributed to their logging wrapper, are this case too): its
    caller's, the next frame out (past generated code such as a dataclass's `__init__`).
    To a library frame further out: the library calls its own deprecated API (the HF
    Trainer reached through zerodp's subclass), the library's.
    """
    while frame is not None and _real(frame.f_code.co_filename) in _MACHINERY:
        frame = frame.f_back
    raised_in = frame
    while frame is not None and not (
        frame.f_code.co_filename == filename and frame.f_lineno == lineno
    ):
        frame = frame.f_back
    if frame is None:
        return None  # attributed to no frame on this stack (another thread's, or made up)
    path = _real(filename)
    if _is_zerodp(path):
        return _place(frame)
    if frame is not raised_in or not _is_library(path):
        return None
    caller = frame.f_back
    while caller is not None and caller.f_code.co_filename.startswith("<"):
        caller = caller.f_back
    if caller is not None and _is_zerodp(_real(caller.f_code.co_filename)):
        return _place(caller)
    return None


def _place(frame: FrameType) -> str:
    path = _real(frame.f_code.co_filename)
    return f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"


@contextlib.contextmanager
def deprecations_caused_by_zerodp(*, show_all: bool = False) -> Iterator[list[CausedWarning]]:
    """Collect the deprecation warnings zerodp causes inside the block (each once).

    Every other warning goes on to where it went before. `show_all`: also show the
    deprecations that the filters in force would hide (Python's defaults hide
    `DeprecationWarning` outside `__main__`, and show a warning once per place); each
    other one is then shown once per process. Pytest's process needs no `show_all`: pytest
    shows every deprecation already. A filter that makes a warning an error still raises it.
    """
    caused: list[CausedWarning] = []
    with warnings.catch_warnings():
        if show_all:
            for category in DEPRECATIONS:
                warnings.filterwarnings("always", category=category)
        previous = warnings.showwarning

        def show(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: Any = None,
            line: str | None = None,
        ) -> None:
            caller = None
            if issubclass(category, DEPRECATIONS):
                caller = zerodp_caller(sys._getframe(1), filename, lineno)
            if caller is not None:
                found = CausedWarning(category.__name__, str(message), caller)
                if found not in caused:
                    caused.append(found)
                return
            key = (category, str(message), filename, lineno)
            if show_all:
                if key in _SHOWN:
                    return
                _SHOWN.add(key)
            previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield caused


def describe(caused: list[CausedWarning]) -> str:
    """The message a test fails with."""
    lines = [f"zerodp caused {len(caused)} deprecation warning(s); call the current API instead:"]
    return "\n".join([*lines, *(f"  {warning}" for warning in caused)])
