"""DeepSpeed's module paths under `zerodp`: the ones zerodp has, and one error for the rest.

With `import zerodp as deepspeed`, a script's `from deepspeed.runtime.lr_schedules
import WarmupLR` becomes `from zerodp.runtime.lr_schedules import WarmupLR`. The
finder here serves those paths: `ALIASES` maps each DeepSpeed module zerodp has
a counterpart for to zerodp's objects (built as a small module on first
import), and a path in `zerodp.compat.unsupported.MODULES` (`zerodp.pipe`,
`zerodp.moe.layer`, ...) raises `UnsupportedModuleError` naming the zerodp
alternative. It sits at the end of `sys.meta_path`, so it is asked only about
names no other finder found: zerodp's own modules are never touched.

Self-contained on purpose: a finder of moved zerodp modules can sit beside it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

from zerodp.compat.unsupported import missing_attribute, module_message, refuse_module, resolve

_PREFIX = "zerodp."

# DeepSpeed module path (below `deepspeed.`) -> {name: "zerodp.module:attribute"}; the key
# "*" names a zerodp module whose attributes the alias forwards for any other name.
ALIASES: dict[str, dict[str, str]] = {
    "runtime": {},
    "runtime.zero": {"*": "zerodp.zero"},
    "runtime.zero.partition_parameters": {
        "*": "zerodp.zero",
        "ZeroParamStatus": "zerodp.group_state:ParamStatus",
    },
    "runtime.zero.offload_config": {"OffloadDeviceEnum": "zerodp.posttrain:OffloadDeviceEnum"},
    "runtime.lr_schedules": {"*": "zerodp.optim.schedulers"},
    "runtime.activation_checkpointing": {"checkpointing": "zerodp.checkpointing"},
    "runtime.activation_checkpointing.checkpointing": {"*": "zerodp.checkpointing"},
    "runtime.engine": {"DeepSpeedEngine": "zerodp.engine:ZeroEngine"},
    "runtime.base_optimizer": {
        "ZeROOptimizer": "zerodp.optim.sharded_optimizer:ZeroOptimizer",
        "DeepSpeedOptimizer": "zerodp.optim.sharded_optimizer:ZeroOptimizer",
    },
}


class _AliasModule(types.ModuleType):
    """A DeepSpeed module path whose names are zerodp's objects (resolved when read)."""

    def __init__(self, fullname: str, names: dict[str, str]) -> None:
        super().__init__(fullname, f"DeepSpeed's {fullname[len(_PREFIX) :]}, served by zerodp")
        self.__path__: list[str] = []  # a package: DeepSpeed's submodules can be imported
        self._names = names

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        names = self.__dict__["_names"]
        if name in names:
            value = resolve(names[name])
        elif "*" in names and hasattr(resolve(names["*"]), name):
            value = getattr(resolve(names["*"]), name)
        else:
            missing_attribute(self.__name__, name)
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        names = set(self.__dict__["_names"]) - {"*"}
        if "*" in self.__dict__["_names"]:
            names |= set(dir(resolve(self.__dict__["_names"]["*"])))
        return sorted(names)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _AliasModule(spec.name, self.names)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class DeepSpeedPaths(importlib.abc.MetaPathFinder):
    """Serves `zerodp.<DeepSpeed module path>` (see the module docstring)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        relative = fullname[len(_PREFIX) :]
        if relative in ALIASES:
            loader = _AliasLoader(ALIASES[relative])
            return importlib.machinery.ModuleSpec(fullname, loader, is_package=True)
        message = module_message(relative)
        if message is not None:
            refuse_module(fullname, message)
        return None


def install() -> None:
    """Put the finder at the end of `sys.meta_path` (once)."""
    if not any(isinstance(finder, DeepSpeedPaths) for finder in sys.meta_path):
        sys.meta_path.append(DeepSpeedPaths())
