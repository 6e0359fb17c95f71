"""A finder on `sys.meta_path` that answers zerodp's old import paths.

It is consulted only for names no other finder found (it is appended last), and only for
the names in `MOVED`: a module that exists is never shadowed. For a public path, the
loader puts the new module in `sys.modules` under the old name, so both names are one
module object (its classes, `isinstance` checks and pickles stay the same); for an
internal one, loading raises.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType, ModuleType


@dataclass(frozen=True)
class Moved:
    """Where an old module path went, and whether importing the old path still works."""

    new: str  # the module's path now
    public: bool  # True: keeps working, with a DeprecationWarning; False: ImportError
    instead: str = ""  # the public names to use, where there are some

    def message(self, old: str) -> str:
        also = f" (or use {self.instead})" if self.instead else ""
        if self.public:
            return f"{old} is deprecated: import {self.new} instead{also}"
        return f"{old} is now {self.new}, an internal module: import it from there{also}"


MOVED: dict[str, Moved] = {
    # The root's modules that moved into packages.
    "zerodp.gathered": Moved(
        "zerodp.full_state.gathered_parameters", public=True, instead="zerodp.zero"
    ),
    "zerodp.state_dicts": Moved(
        "zerodp.full_state.state_dicts", public=True, instead="zerodp.zero"
    ),
    "zerodp.data": Moved("zerodp.engine.data_loader", public=True),
    "zerodp.safetensors_stream": Moved("zerodp.checkpoint.safetensors_stream", public=True),
    "zerodp.managed": Moved(
        "zerodp.full_state.param_managers", public=False, instead="zerodp.zero or zerodp.utils"
    ),
    "zerodp.accessors": Moved(
        "zerodp.full_state.param_state", public=False, instead="zerodp.utils"
    ),
    "zerodp.compile": Moved(
        "zerodp.engine.compile", public=False, instead='the config\'s "compile" block'
    ),
    # Modules renamed to say what they hold.
    "zerodp.backward.exposure": Moved("zerodp.backward.param_grad_views", public=False),
    "zerodp.checkpoint.plain": Moved("zerodp.checkpoint.json_state", public=False),
    "zerodp.checkpoint.deepspeed.targets": Moved(
        "zerodp.checkpoint.deepspeed.destinations", public=False
    ),
    "zerodp.optim.parts": Moved("zerodp.optim.torch_optimizers", public=False),
}


def _importer_stacklevel() -> int:
    """For a warning raised by this function's caller: the `stacklevel` of the first frame
    that is not the import system, this package or the root's `__getattr__` (the line that
    imported the old path). `warnings` itself does not count the import system's frozen
    frames, so neither does this."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == "zerodp" or name.startswith(("importlib", "zerodp.old_paths"))):
            return level
        if not name.startswith("importlib._bootstrap"):
            level += 1
        frame = frame.f_back
    return 1


class _OldPathLoader(importlib.abc.Loader):
    def __init__(self, old: str, moved: Moved) -> None:
        self.old = old
        self.moved = moved

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module; `exec_module` replaces it

    def exec_module(self, module: ModuleType) -> None:
        if not self.moved.public:
            # ImportError, not ModuleNotFoundError: `from zerodp import managed` would
            # swallow the latter and say only "cannot import name 'managed'".
            raise ImportError(self.moved.message(self.old), name=self.old)
        warnings.warn(
            self.moved.message(self.old),
            DeprecationWarning,
            stacklevel=_importer_stacklevel(),
        )
        # The import system returns what `sys.modules` holds under the old name after this.
        sys.modules[self.old] = importlib.import_module(self.moved.new)


class OldPathFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths in `MOVED` (and nothing else)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        moved = MOVED.get(fullname)
        if moved is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _OldPathLoader(fullname, moved))


def install() -> None:
    """Append the finder to `sys.meta_path` once (a reload of zerodp does not add another)."""
    if not any(isinstance(finder, OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(OldPathFinder())


def root_attribute(name: str) -> ModuleType:
    """`zerodp.<name>` for an old root module not imported yet (the root's `__getattr__`):
    the module for a public path, else AttributeError naming the new path."""
    old = f"zerodp.{name}"
    moved = MOVED.get(old)
    if moved is None:
        raise AttributeError(f"module 'zerodp' has no attribute '{name}'")
    if not moved.public:
        raise AttributeError(moved.message(old))
    return importlib.import_module(old)
