"""Which model parameters the optimizer updates, in which param group, with which options."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class ParamGroupSpec:
    params: list[nn.Parameter]
    options: dict[str, Any] = field(default_factory=dict)  # everything but "params"


def resolve_param_groups(
    model: nn.Module,
    model_parameters: Iterable[Any] | None,
    optimizer: Any,
) -> list[ParamGroupSpec]:
    """Param groups from (first that is given) an optimizer instance (or a list of them, each
    on its own parameters: their groups in order), model_parameters, the model.

    Frozen parameters (requires_grad=False) are dropped. Every trainable
    parameter of the model must be in exactly one group: zerodp reduces and
    steps parameters by groups, and a trainable parameter outside them would
    silently keep a local, unaveraged gradient.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        raw: list[Any] = [dict(g) for g in optimizer.param_groups]
    elif is_optimizer_list(optimizer):
        raw = [dict(g) for part in optimizer for g in part.param_groups]
    elif model_parameters is not None:
        raw = list(model_parameters)
    else:
        raw = [p for p in model.parameters()]
    if raw and all(isinstance(item, dict) for item in raw):
        specs = [
            ParamGroupSpec(
                params=_as_param_list(item["params"]),
                options={k: v for k, v in item.items() if k != "params"},
            )
            for item in raw
        ]
    elif all(isinstance(item, torch.Tensor) for item in raw):
        specs = [ParamGroupSpec(params=list(raw))]
    else:
        raise TypeError(
            "model_parameters must be an iterable of parameters or of param-group dicts "
            "(each with a 'params' key), not a mixture"
        )

    names = {id(p): n for n, p in model.named_parameters()}
    seen: set[int] = set()
    for index, spec in enumerate(specs):
        for param in spec.params:
            if id(param) not in names:
                raise ValueError(
                    f"param group {index} contains a tensor of shape {tuple(param.shape)} that "
                    "is not a parameter of the model passed to zerodp.initialize; pass the "
                    "model's own parameters"
                )
            if id(param) in seen:
                raise ValueError(
                    f"parameter '{names[id(param)]}' appears in more than one param group; "
                    "list each parameter once"
                )
            seen.add(id(param))
        spec.params = [p for p in spec.params if p.requires_grad]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(
            f"trainable parameters not in any optimizer param group: {shown}; add them to "
            "model_parameters (or the optimizer), or set requires_grad=False to freeze them"
        )
    return specs


def is_optimizer_list(value: Any) -> bool:
    """A list or tuple of torch optimizers (each on its own parameters)."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(item, torch.optim.Optimizer) for item in value)
    )


def _as_param_list(params: Any) -> list[nn.Parameter]:
    if isinstance(params, torch.Tensor):
        return [params]  # type: ignore[list-item]
    return list(params)
