"""The checks of the composition table that only the engine can make, asked once for every
dimension ([Note: composition table] in `zerodp.parallel.composition`).

Config validation refuses what a config's keys turn on; these two need the model or
the optimizer: a model built sharded by `zero.Init` (before any split), and an
optimizer that reads whole tensors (once the optimizers are built). Each is a
collective over the world, so every rank raises the same error.
"""

from __future__ import annotations

from torch import nn

from zerodp.comm.subgroups import GroupComms
from zerodp.errors import ConfigError
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
