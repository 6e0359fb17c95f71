"""A finder on `sys.meta_path` that answers zerodp's old import paths.

It answers only the names in `MOVED` and the modules of the packages there (a moved
package's modules moved with it); no module exists at those names, so nothing real is
shadowed although the finder comes first. For a public path, the
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

# [Note: retiring old paths]
# An old path is answered for two minor releases after the release that moved it, then
# dropped: a path moved during 0.1.x works (or fails naming its new place) through 0.2.x and
# is gone in 0.3.0. `Moved.removed_in` records that release for each path, and
# tests/unit/test_old_paths.py fails once the package's version reaches it, so the entry is
# removed with the release rather than forgotten. A public path's DeprecationWarning names
# the release too, so a user sees the deadline at the line that imports it.
MOVED_DURING = "0.1"
REMOVED_IN = "0.3.0"


@dataclass(frozen=True)
class Moved:
    """Where an old module path went, and whether importing the old path still works."""

    new: str  # the module's path now
    public: bool  # True: keeps working, with a DeprecationWarning; False: ImportError
    instead: str = ""  # the public names to use, where there are some
    package: bool = False  # a package: each of its modules moved with it (`old.x` -> `new.x`)
    removed_in: str = REMOVED_IN  # the release that drops the old path ([Note: retiring old paths])

    def message(self, old: str) -> str:
        also = f" (or use {self.instead})" if self.instead else ""
        if self.public:
            return (
                f"{old} is deprecated: import {self.new} instead{also}; the old path is "
                f"removed in zerodp {self.removed_in}"
            )
        if self.package:
            return (
                f"{old} is now {self.new}, an internal package: import from there (its "
                f"modules moved with it: {old}.<name> is {self.new}.<name>){also}"
            )
        return f"{old} is now {self.new}, an internal module: import it from there{also}"

    def below(self, rest: str) -> Moved:
        """The move of module `rest` inside this moved package."""
        return Moved(f"{self.new}.{rest}", self.public, self.instead, False, self.removed_in)


MOVED: dict[str, Moved] = {
    # The root's modules that moved into packages.
    "zerodp.gathered": Moved(
        "zerodp.full_state.gathered_parameters", public=True, instead="zerodp.zero"
    ),
    "zerodp.state_dicts": Moved(
        "zerodp.full_state.state_dicts", public=True, instead="zerodp.zero"
    ),
    "zerodp.data": Moved("zerodp.engine.data_loader", public=True),
    "zerodp.safetensors_stream": Moved("zerodp.checkpoint_io.safetensors_stream", public=True),
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
    "zerodp.checkpoint.plain": Moved("zerodp.checkpoint_io.json_state", public=False),
    "zerodp.checkpoint.deepspeed.targets": Moved(
        "zerodp.checkpoint_io.deepspeed.destinations", public=False
    ),
    "zerodp.optim.parts": Moved("zerodp.optim.torch_optimizers", public=False),
    # comm/'s failure handling, moved into comm/faults/ (and renamed), and its other renames.
    "zerodp.comm.whereabouts": Moved("zerodp.comm.faults.uneven_inputs", public=False),
    "zerodp.comm.order": Moved("zerodp.comm.faults.collective_order", public=False),
    "zerodp.comm.history": Moved("zerodp.comm.faults.collective_history", public=False),
    "zerodp.comm.failures": Moved("zerodp.comm.faults.failure_notices", public=False),
    "zerodp.comm.waiting": Moved("zerodp.comm.faults.polled_waits", public=False),
    "zerodp.comm.teardown": Moved("zerodp.comm.faults.teardown", public=False),
    "zerodp.comm.wrappers": Moved("zerodp.comm.data_parallel_wrappers", public=False),
    "zerodp.comm.objects": Moved("zerodp.comm.object_collectives", public=False),
    # Packages and modules renamed so that a package's name says what it holds (issue 42): no
    # two rooms called "group", "checkpoint" apart from DeepSpeed's activation-checkpointing
    # face, no module name used twice for two things.
    "zerodp.params": Moved("zerodp.stage3", public=False, package=True),
    "zerodp.group": Moved("zerodp.group_state", public=False, package=True),
    "zerodp.checkpoint": Moved("zerodp.checkpoint_io", public=True, package=True),
    "zerodp.config.compat": Moved("zerodp.config.deepspeed_keys", public=False, package=True),
    "zerodp.comm.group": Moved("zerodp.comm.process_group", public=False),
    "zerodp.comm.join": Moved("zerodp.comm.join_protocol", public=False),
    "zerodp.engine.join": Moved("zerodp.engine.uneven_join", public=False),
    "zerodp.backward.plan": Moved("zerodp.backward.reduction_plan", public=False),
    "zerodp.precision.inputs": Moved("zerodp.precision.input_casting", public=False),
    "zerodp.sequence.inputs": Moved("zerodp.sequence.input_split", public=False),
    "zerodp.sequence.group": Moved("zerodp.sequence.sequence_group", public=False),
    "zerodp.optim.tensorwise.plan": Moved("zerodp.optim.tensorwise.ownership", public=False),
}


def moved_from(old: str) -> Moved | None:
    """What became of `old`: its own entry, else its moved package's (`zerodp.params.x`).

    A name under a public package's new path that is an older name's (`from zerodp.checkpoint
    import plain` asks for `zerodp.checkpoint_io.plain`: the import system names the aliased
    parent by its real name) is answered as that older name.
    """
    moved = MOVED.get(old)
    if moved is not None:
        return moved
    for former, entry in MOVED.items():
        if entry.package and entry.public and old.startswith(f"{entry.new}."):
            older = MOVED.get(former + old.removeprefix(entry.new))
            if older is not None:
                return older
    parent, _, rest = old.partition(".")
    while rest:
        head, _, rest_tail = rest.partition(".")
        parent = f"{parent}.{head}"
        package = MOVED.get(parent)
        if package is not None and package.package and rest_tail:
            return package.below(rest_tail)
        rest = rest_tail
    return None


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
        if not fullname.startswith("zerodp."):
            return None
        moved = moved_from(fullname)
        if moved is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _OldPathLoader(fullname, moved))


def install() -> None:
    """Put the finder first on `sys.meta_path`, once (a reload of zerodp does not add another).

    First, not last: a moved package's modules (`zerodp.checkpoint.consolidate`) would
    otherwise be found by the path finder through the aliased parent's `__path__` and loaded
    a second time under the old name, as a second module object. Nothing real is shadowed:
    no module exists at an old path (tests/unit/test_old_paths.py checks it).
    """
    if not any(isinstance(finder, OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPathFinder())


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
