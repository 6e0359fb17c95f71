"""The checks of the composition table that only the engine can make, asked once for every
dimension ([Note: composition table] in `zerodp.parallel.composition`).

Config validation refuses what a config's keys turn on; these need the model, the
optimizer or the forward's arguments: a model built sharded by `zero.Init` (before any
split), an optimizer that reads whole tensors (once the optimizers are built), each a
collective over the world so that every rank raises the same error; and a mixture-of-experts
model asked for its router logits (at each forward, from the arguments every rank of a
group passes alike).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp.comm.subgroups import GroupComms
from zerodp.errors import ConfigError, UsageError
from zerodp.parallel.composition import Feature, refusal_for
from zerodp.stage3 import zero_parameter


def check_model_composes(module: nn.Module, comms: GroupComms) -> None:
    """Refuse a model built under `zero.Init` where a dimension does not take one."""
    error = None
    message = refusal_for(Feature.ZERO_INIT, comms.dims)
    if message is not None and any(
        zero_parameter.owner_of(p) is not None for p in module.parameters()
    ):
        error = ConfigError(message)
    comms.world.raise_if_any_failed(error)


def check_optimizer_composes(comms: GroupComms, *, steps_whole_tensors: bool) -> None:
    """Refuse an optimizer that reads whole tensors where a dimension splits them."""
    error = None
    message = refusal_for(Feature.WHOLE_TENSOR_OPTIMIZERS, comms.dims)
    if steps_whole_tensors and message is not None:
        error = ConfigError(message)
    comms.world.raise_if_any_failed(error)


def refuse_router_aux_loss_where_refused(
    module: nn.Module, comms: GroupComms
) -> RemovableHandle | None:
    """Refuse, at the forward, `output_router_logits=True` (the forward's argument, else the
    model config's) where a dimension does not take the auxiliary loss: the argument decides
    it, so it is read where it is passed."""
    message = refusal_for(Feature.ROUTER_AUX_LOSS, comms.dims)
    if message is None:
        return None

    def refuse(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _asks_for_router_logits(module, args, kwargs):
            raise UsageError(message)

    # First of the forward's hooks, so that nothing of the forward (a gather, an agreement)
    # has begun when it refuses.
    return module.register_forward_pre_hook(refuse, with_kwargs=True, prepend=True)


def _asks_for_router_logits(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """`output_router_logits` as the forward gets it (by name or position), else the model
    config's."""
    asked = kwargs.get("output_router_logits")
    if asked is None and args:
        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        except TypeError:  # the forward itself will say what is wrong with its arguments
            bound = None
        asked = None if bound is None else bound.arguments.get("output_router_logits")
    if asked is None:
        asked = getattr(getattr(module, "config", None), "output_router_logits", False)
    return bool(asked)
