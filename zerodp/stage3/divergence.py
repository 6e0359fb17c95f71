"""What a stage 3 collective does, in words, and what to do when ranks issue different ones.

The collective order check (`zerodp.comm.faults.collective_order`) knows collectives as
(operation, group order); these turn them into the names a user knows: each rank's message
says which module's parameters it gathers or reduces, and the advice names the module that
holds the diverging ones, to be marked as a leaf (see [Note: leaf modules]).
"""

from __future__ import annotations

from torch import nn

from zerodp.comm.faults.collective_order import Entry
from zerodp.group_state import GroupIndex, GroupState

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _modules_of(state: GroupState) -> list[str]:
    modules: list[str] = []
    for name in state.names:
        module = _module_of(name)
        if module not in modules:
            modules.append(module)
    return modules


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


class DivergenceExplainer:
    """`describe` and `advise` for `CollectiveOrder`, in terms of one model's modules."""

    def __init__(self, root: nn.Module, index: GroupIndex) -> None:
        self._modules = dict(root.named_modules())
        self._by_order = {state.order: state for state in index}
        self._root_name = type(root).__name__

    def describe(self, entry: Entry) -> str:
        operation, tag = entry
        state = self._by_order.get(tag)
        if state is None:  # pragma: no cover - entries always name a group
            return f"{operation}s group {tag}"
        modules = ", ".join(f"`{m or self._root_name}`" for m in _modules_of(state)[:3])
        verb = {
            "gather": "gathers the parameters of",
            "gather secondary": "gathers (from hpZ's secondary shards) the parameters of",
            "reduce across replicas": "averages across replicas the gradients of",
        }.get(operation, "reduces the gradients of")
        return f"{verb} {modules} ({_shown(state.names)})"

    def advise(self, entries: list[Entry]) -> str:
        reduced = [e for e in entries if e[0] == "reduce" and e[1] in self._by_order]
        if reduced:  # a group's gradients were complete on some ranks before the others
            path = _common_prefix([m for _, tag in reduced for m in self._paths(tag)])
            module, cls = self._leaf_candidate(self._chooser_of(path))
            if cls:
                return (
                    f"The gradients of `{module}` ({cls}) were complete on some ranks only "
                    "(some of its parameters are used on some ranks only): mark it as a "
                    f"leaf, reduced when its backward is done, with {self._how(cls)}"
                )
        named = all(tag in self._by_order for _, tag in entries)
        paths = [m for _, tag in entries if tag in self._by_order for m in self._paths(tag)]
        common, cls = self._leaf_candidate(_common_prefix(paths) if named else "")
        if cls:
            return (
                f"They differ inside `{common}` ({cls}): mark it as a leaf, gathered as one "
                f"unit, with {self._how(cls)}"
            )
        where = (
            "Some ranks run modules others skip"
            if not named
            else ("They have no common module below the model itself")
        )
        return (
            f"{where}: make every rank run the same modules (a dummy input where a rank's "
            "batch has none), or mark a module that every rank enters and that contains "
            "the ones named here as a leaf (zerodp.zero.set_z3_leaf_modules)"
        )

    def _chooser_of(self, path: str) -> str:
        """The nearest module above `path` that holds alternatives (a list of experts), else
        `path` itself: the module whose forward chose which of them to run."""
        parts = path.split(".") if path else []
        for end in range(len(parts) - 1, 1, -1):
            if isinstance(self._modules.get(".".join(parts[:end])), _CONTAINERS):
                return ".".join(parts[: end - 1])
        return path  # (a list right under the model is its list of layers, not a choice)

    def _leaf_candidate(self, path: str) -> tuple[str, str]:
        """The module at `path` or the nearest one above that is not a container, and its
        class name ("" for the model itself)."""
        while path and isinstance(self._modules.get(path), _CONTAINERS):
            path = _module_of(path)
        module = self._modules.get(path)
        return (path, type(module).__name__) if path and module is not None else ("", "")

    @staticmethod
    def _how(class_name: str) -> str:
        return (
            f"zerodp.zero.set_z3_leaf_modules(model, [{class_name}]) or the config's "
            f'"zero_optimization": {{"leaf_module": {{"classes": ["{class_name}"]}}}}'
        )

    def _paths(self, tag: int) -> list[str]:
        return _modules_of(self._by_order[tag])


def _common_prefix(paths: list[str]) -> str:
    if not paths:
        return ""
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if any(part != level[0] for part in level):
            break
        common.append(level[0])
    return ".".join(common)
