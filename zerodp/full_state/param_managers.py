"""Which engine manages a parameter: the one map from a parameter to its manager.

The public helpers (`zerodp.utils`, `zerodp.zero`, `GatheredParameters`) find
the engine of a parameter here. They see it as a `ParamManager`, the narrow
surface they need, so this module (and they) never import the engine.
A parameter has at most one live manager: a second engine on a model that
is already managed is refused before it touches anything.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zerodp.comm import Comm
from zerodp.errors import LifecycleError
from zerodp.full_state.param_state import FullStateAccessor
from zerodp.group_state import GroupIndex, GroupState, ParamStatus
from zerodp.tensor_parallel import TensorParallelism


class ParamRuntimeView(Protocol):
    """The parameter runtime (stage 3, or its null object), as the public helpers see it."""

    @property
    def sharded_states(self) -> list[GroupState]: ...

    def status(self, param: nn.Parameter) -> ParamStatus: ...


class ParamManager(Protocol):
    """What the public helpers use of the engine that manages a parameter."""

    @property
    def comm(self) -> Comm: ...

    @property
    def groups(self) -> GroupIndex: ...

    @property
    def full_state(self) -> FullStateAccessor: ...

    @property
    def params(self) -> ParamRuntimeView: ...

    @property
    def global_rank(self) -> int: ...

    # With tensor parallelism, which parameters are slices (export gathers them whole).
    tensor_parallel: TensorParallelism | None

    def ensure_no_stale_backward(self) -> None: ...


# Weakly keyed by identity: a dead parameter's entry goes with it.
_MANAGERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def manager_of(param: torch.Tensor) -> ParamManager | None:
    """The live engine that manages `param`, or None."""
    manager: ParamManager | None = _MANAGERS.get(param)
    return manager


def manager_of_module(module: nn.Module) -> ParamManager | None:
    """The engine that manages any of `module`'s parameters, or None."""
    return next((m for m in map(manager_of, module.parameters()) if m is not None), None)


def refuse_managed(module: nn.Module) -> None:
    """Raise if a live engine already manages one of `module`'s parameters."""
    for name, param in module.named_parameters():
        if manager_of(param) is not None:
            raise LifecycleError(
                f"parameter '{name}' is already managed by a zerodp engine; call "
                "engine.destroy() on that engine first, or keep training with it"
            )


def register(manager: ParamManager, params: list[nn.Parameter]) -> None:
    for param in params:
        _MANAGERS[param] = manager


def unregister(params: list[nn.Parameter]) -> None:
    for param in params:
        _MANAGERS.pop(param, None)
