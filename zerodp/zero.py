"""Stage 3's public names: parameter status, gathering outside forward, full state dicts,
leaf modules."""

from __future__ import annotations

from torch import nn

from zerodp.full_state.gathered_parameters import GatheredParameters
from zerodp.full_state.param_managers import manager_of
from zerodp.full_state.state_dicts import full_state_dict, load_state_dict, save_state_dict
from zerodp.group_state import ParamStatus
from zerodp.stage3 import leaf, zero_parameter
from zerodp.stage3.init import Init

__all__ = [
    "GatheredParameters",
    "Init",
    "ParamStatus",
    "full_state_dict",
    "get_z3_leaf_modules",
    "is_persistent",
    "load_state_dict",
    "param_status",
    "save_state_dict",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]


def param_status(param: nn.Parameter) -> ParamStatus:
    """NOT_AVAILABLE, INFLIGHT or AVAILABLE; parameters zerodp does not shard are AVAILABLE."""
    manager = manager_of(param)
    if manager is not None:
        manager.ensure_no_stale_backward()
        return manager.params.status(param)
    owner = zero_parameter.owner_of(param)  # built under zero.Init, no engine yet
    state = owner.group_of(param) if owner is not None else None
    return ParamStatus.AVAILABLE if state is None else state.status


def is_persistent(param: nn.Parameter) -> bool:
    """Whether `param` stays gathered all the time (every parameter at stages 0-2; at stage 3,
    those below stage3_param_persistence_threshold)."""
    manager = manager_of(param)
    if manager is None:
        return zero_parameter.owner_of(param) is None
    state = manager.groups.state_of(param)
    return state is None or state.persistent


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Make every module of `model` that is an instance of one of `leaf_module_classes`
    (classes, or class names) a stage 3 leaf; returns the modules marked.

    A leaf's parameters, those of its whole subtree, are gathered together when it is
    entered and released when it is done, in forward and in backward, and no hook fires
    inside it: ranks may run different submodules inside it (the experts their tokens were
    routed to) and still issue the same collectives. Takes effect from the next forward,
    before or after `zerodp.initialize`; at stages 0-2 it changes nothing. No module
    found raises `UsageError` unless `raise_if_not_found=False`. The config's
    `zero_optimization.leaf_module` does the same without code.
    """
    return leaf.set_leaf_modules(model, leaf_module_classes, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Undo `set_z3_leaf_modules` for these classes; returns the modules unmarked."""
    return leaf.unset_leaf_modules(model, leaf_module_classes, raise_if_not_found)


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` (a module) is marked as a stage 3 leaf."""
    return leaf.is_leaf(model)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` marked as stage 3 leaves, in `model.modules()` order."""
    return leaf.leaf_modules(model)
