"""Leaf modules: subtrees that stage 3 gathers as one unit, so ranks may take any path inside.

[Note: leaf modules]
A stage 3 gather is a collective, so every rank must gather the same groups in
the same order. A mixture-of-experts block breaks that on purpose (each rank
runs the experts its tokens were routed to), and so does a branch some ranks
skip. Marking the block as a leaf makes it one unit: when it is entered, in
forward and in backward, the groups of every module in its subtree are
gathered together (in one fixed order, the same on every rank), and they are
released when it is done; no module hook fires inside it. Whatever path a
rank takes inside the leaf, its collectives are those of the leaf as a whole.

Gradients follow the same rule: a leaf parameter that got no gradient on
this rank (an expert no token was routed to) contributes zeros when the
leaf's backward is done, so every rank reduces the leaf's groups at the same
point. The end of the leaf's backward is marked by an identity autograd
function on the leaf's inputs (`LeafEntry`): its backward runs only after
every gradient inside the leaf is computed, and before any hook on those
inputs (the hook of the module that produced them) can gather the next
module's parameters.

Marks live here (weakly, never on the module or its parameters) and can
change at any time; every runtime re-reads them when the version changes.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from zerodp._tree import grad_tensors_in
from zerodp.errors import ConfigError, UsageError
from zerodp.group_state import GroupState

_LEAVES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class _Version:
    value = 0  # bumped by every change of the marks


LeafSpec = type | str


def _class_names(module: nn.Module) -> tuple[str, str]:
    cls = type(module)
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def _matches_class(module: nn.Module, spec: LeafSpec) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    return spec in _class_names(module)


def _mark(modules: list[nn.Module], on: bool) -> None:
    for module in modules:
        if on:
            _LEAVES.add(module)
        else:
            _LEAVES.discard(module)
    _Version.value += 1


def _matching(model: nn.Module, specs: Sequence[LeafSpec]) -> list[nn.Module]:
    return [m for m in model.modules() if any(_matches_class(m, spec) for spec in specs)]


def _no_match(specs: Sequence[LeafSpec], model: nn.Module) -> UsageError:
    shown = ", ".join(s.__name__ if isinstance(s, type) else repr(s) for s in specs)
    classes = sorted({type(m).__name__ for m in model.modules()})
    return UsageError(
        f"no module of {type(model).__name__} is an instance of {shown}; its module classes "
        f"are {', '.join(classes)}"
    )


def set_leaf_modules(
    model: nn.Module, classes: Sequence[LeafSpec], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of `model` of one of `classes` (types, or class names) as a leaf."""
    return _mark_matching(model, classes, raise_if_not_found, on=True)


def unset_leaf_modules(
    model: nn.Module, classes: Sequence[LeafSpec], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Remove the leaf mark from every module of `model` of one of `classes`."""
    return _mark_matching(model, classes, raise_if_not_found, on=False)


def _mark_matching(
    model: nn.Module, classes: Sequence[LeafSpec], raise_if_not_found: bool, *, on: bool
) -> list[nn.Module]:
    found = _matching(model, list(classes))
    if not found and raise_if_not_found:
        raise _no_match(list(classes), model)
    _mark(found, on=on)
    return found


def is_leaf(module: nn.Module) -> bool:
    return module in _LEAVES


def leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if m in _LEAVES]


def _config_match(kind: str, value: str, name: str, module: nn.Module) -> bool:
    if kind == "classes":
        return value in _class_names(module)
    if kind == "names":
        return fnmatch.fnmatchcase(name, value)
    return bool(name) and name.endswith(value)


def mark_from_config(
    model: nn.Module, classes: Iterable[str], names: Iterable[str], name_suffixes: Iterable[str]
) -> list[nn.Module]:
    """Mark what `zero_optimization.leaf_module` names; an entry that matches nothing is an error.

    `classes`: class names (`MoEBlock`) or qualified class names. `names`: module names as
    `named_modules()` gives them, exact or with shell wildcards (`layers.*.mlp`).
    `name_suffixes`: the end of module names (`mlp` marks `layers.0.mlp`, `layers.1.mlp`).
    """
    named = list(model.named_modules())
    rules = [("classes", c) for c in classes] + [("names", n) for n in names]
    rules += [("name_suffixes", s) for s in name_suffixes]
    found: list[nn.Module] = []
    unmatched = []
    for kind, value in rules:
        hits = [m for n, m in named if _config_match(kind, value, n, m)]
        if not hits:
            unmatched.append(f"{kind} entry {value!r}")
        found += [m for m in hits if m not in found]
    if unmatched:
        classes_seen = sorted({type(m).__name__ for _, m in named})
        raise ConfigError(
            f"zero_optimization.leaf_module: {', '.join(unmatched)} matches no module of "
            f"{type(model).__name__}; its module classes are {', '.join(classes_seen)}, and "
            "names are as model.named_modules() gives them"
        )
    _mark(found, on=True)
    return found


class LeafPlan:
    """The leaves under one root and the groups of each leaf's subtree, kept up to date."""

    def __init__(
        self,
        root: nn.Module,
        module_groups: dict[nn.Module, list[GroupState]],
        on_change: Callable[[frozenset[GroupState]], None] | None = None,
    ) -> None:
        self._root = root
        self._module_groups = module_groups
        self._on_change = on_change
        self._version = -1
        self._leaves: frozenset[nn.Module] = frozenset()
        self._subtree: dict[nn.Module, list[GroupState]] = {}
        self._in_leaves: set[GroupState] = set()

    def _refresh(self) -> None:
        if self._version == _Version.value:
            return
        self._version = _Version.value
        self._leaves = frozenset(m for m in self._root.modules() if m in _LEAVES)
        self._subtree = {}
        self._in_leaves = set()
        for leaf in self._leaves:
            groups: list[GroupState] = []
            for module in leaf.modules():
                for state in self._module_groups.get(module, []):
                    if state not in groups:
                        groups.append(state)
            self._subtree[leaf] = groups
            self._in_leaves.update(groups)
        if self._on_change is not None:
            self._on_change(frozenset(self._in_leaves))

    def is_leaf(self, module: nn.Module) -> bool:
        if self._version != _Version.value:
            self._refresh()
        return module in self._leaves

    def subtree_groups(self, leaf: nn.Module) -> list[GroupState]:
        """Every group of every module inside `leaf` (itself included), in module order."""
        self._refresh()
        return self._subtree.get(leaf, [])


class LeafEntry(torch.autograd.Function):
    """Identity on a leaf's inputs whose backward marks the end of the leaf's backward."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.on_backward = on_backward
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.on_backward()
        return (None, *grads)


def enter_leaf(
    args: tuple[Any, ...], kwargs: dict[str, Any], on_backward: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The leaf's arguments with every tensor that needs a gradient passed through `LeafEntry`.

    Only top-level tensors (positional and keyword) are replaced; None when there is none
    to replace, or when a tensor that needs a gradient is nested deeper (the caller then
    falls back to a hook on the inputs).
    """
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not positions and not keys:
        return None
    if len(positions) + len(keys) != len(grad_tensors_in((args, kwargs))):
        return None
    outs = LeafEntry.apply(on_backward, *[args[i] for i in positions], *[kwargs[k] for k in keys])
    new_args = list(args)
    for index, out in zip(positions, outs[: len(positions)], strict=True):
        new_args[index] = out
    new_kwargs = dict(kwargs)
    for key, out in zip(keys, outs[len(positions) :], strict=True):
        new_kwargs[key] = out
    return tuple(new_args), new_kwargs


def mark_leaf_modules(modules: Iterable[nn.Module]) -> None:
    """Mark these module instances as leaves (what `torch.compile` per block needs)."""
    _mark(list(modules), on=True)
