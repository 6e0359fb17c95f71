"""The torch optimizer stepping this rank's shards: from the config, an instance or a callable."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerodp.errors import ConfigError

# Optimizers whose update of each element reads only that element's gradient
# and state: exactly the ones that can step a flat shard instead of the tensors.
_ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
_NOT_SHARDABLE = (torch.optim.LBFGS, torch.optim.SparseAdam)
_FUSED = ("Adam", "AdamW")  # fused kernels on the CPU and on accelerators

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def build_optimizer(
    user_optimizer: torch.optim.Optimizer | OptimizerFactory | None,
    config_optimizer: Any,
    shard_groups: list[dict[str, Any]],
    prefer_fused: bool = False,
) -> torch.optim.Optimizer:
    """`shard_groups` are param-group dicts whose 'params' are this rank's shards.

    With `prefer_fused` (the step runs on the host: optimizer offload) a config
    optimizer that has a fused kernel and says neither `fused` nor `foreach` gets
    `fused=True`: torch's fused CPU AdamW measured 4x faster than its foreach one
    here (docs/offload.md).
    """
    if isinstance(user_optimizer, torch.optim.Optimizer):
        optimizer = _repoint(user_optimizer, shard_groups)
    elif callable(user_optimizer):
        optimizer = user_optimizer(shard_groups)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer callable returned {type(optimizer).__name__}; it must return a "
                "torch.optim.Optimizer built on the param groups it is given"
            )
    elif config_optimizer is not None:
        class_name, kwargs = config_optimizer.torch_kwargs()
        if (
            prefer_fused
            and class_name in _FUSED
            and kwargs.get("fused") is None
            and kwargs.get("foreach") is None
        ):
            kwargs = {**kwargs, "fused": True}
        optimizer = getattr(torch.optim, class_name)(shard_groups, **kwargs)
    else:
        raise ConfigError(
            "no optimizer: add an 'optimizer' block to the config (e.g. "
            '{"type": "AdamW", "params": {"lr": 1e-3}}) or pass optimizer= to zerodp.initialize'
        )
    _check_shardable(optimizer)
    return optimizer


def _repoint(optimizer: torch.optim.Optimizer, shard_groups: list[dict[str, Any]]) -> Any:
    """Keep the user's optimizer object (and any scheduler built on it); step shards instead."""
    if len(optimizer.param_groups) != len(shard_groups):
        raise RuntimeError("internal error: param groups and shard groups disagree")
    if optimizer.state:
        warnings.warn(
            "the optimizer passed to zerodp.initialize already has state; zerodp starts it "
            "afresh on the sharded parameters (load a checkpoint to restore state)",
            stacklevel=3,
        )
    for group, shard_group in zip(optimizer.param_groups, shard_groups, strict=True):
        group["params"] = shard_group["params"]
    optimizer.state = defaultdict(dict)
    return optimizer


def _check_shardable(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer, _NOT_SHARDABLE):
        raise TypeError(
            f"{type(optimizer).__name__} cannot step flat shards (its update is not "
            "elementwise); use an elementwise optimizer such as AdamW or SGD"
        )
    if not isinstance(optimizer, _ELEMENTWISE):
        warnings.warn(
            f"zerodp steps flat shards of the parameters; {type(optimizer).__name__} must "
            "update each element from its own gradient and state only (as Adam and SGD do)",
            stacklevel=3,
        )


def shard_parameter(owned: torch.Tensor) -> nn.Parameter:
    """A parameter object for the optimizer that aliases this rank's owned range."""
    return nn.Parameter(owned, requires_grad=True)
