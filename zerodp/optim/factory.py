"""Where the engine's torch optimizers come from: an instance, a list, a callable or the config.

- `optimizer=opt` (a torch optimizer built on the model's parameters): zerodp
  keeps the object and re-points its param groups at what it steps.
- `optimizer=[opt_a, opt_b]`: several, each on its own parameters (torch's
  Muon for the matrices and AdamW for the rest, as torch's documentation
  writes it); the engine steps them together, once per step.
- `optimizer=callable(param_groups)`: called with zerodp's param groups.
- the config's "optimizer" block (`zerodp.config.optimizer`; "Muon" is two
  optimizers, see `zerodp.optim.muon_config`).

Which tensors each optimizer is handed (flat shards or whole tensors) is
decided by its class (`zerodp.optim.tensorwise.selection`), in `torch_optimizers`.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.config.optimizer import UNCORRECTED_ADAM
from zerodp.errors import ConfigError
from zerodp.optim.muon_config import split_for_muon
from zerodp.optim.param_groups import ParamGroupSpec, is_optimizer_list
from zerodp.optim.torch_optimizers import OptimizerSource
from zerodp.optim.uncorrected_adam import UncorrectedAdam

_FUSED = ("Adam", "AdamW")  # fused kernels on the CPU and on accelerators
_FUSED_DEVICES = ("cpu", "cuda", "xpu", "mps")  # where torch has those kernels


def steps_fused(device: torch.device) -> bool:
    """Whether a config Adam(W) stepping on `device` gets torch's fused kernel by default.

    It is the faster kernel (torch's fused CPU AdamW against its foreach one:
    `python bench/offload.py --adamw-kernels`), and one kernel for every placement
    keeps optimizer offload on and off bitwise equal on a CPU-only machine
    (docs/offload.md).
    """
    return device.type in _FUSED_DEVICES


def optimizer_sources(
    user_optimizer: Any,
    config_optimizer: Any,
    specs: list[ParamGroupSpec],
    names: dict[int, str],
    prefer_fused: bool = False,
) -> tuple[list[ParamGroupSpec], list[OptimizerSource], dict[str, tuple[int, ...]]]:
    """(the param groups, possibly split, their optimizer sources, shapes to step in).

    With `prefer_fused` (see `steps_fused`) a config optimizer that has a fused kernel
    and says neither `fused` nor `foreach` gets `fused=True`.
    """
    every = list(range(len(specs)))
    if isinstance(user_optimizer, torch.optim.Optimizer):
        return specs, [OptimizerSource(groups=every, instance=user_optimizer)], {}
    if is_optimizer_list(user_optimizer):
        sources, start = [], 0
        for optimizer in user_optimizer:
            count = len(optimizer.param_groups)
            sources.append(
                OptimizerSource(groups=list(range(start, start + count)), instance=optimizer)
            )
            start += count
        return specs, sources, {}
    if callable(user_optimizer):
        return specs, [OptimizerSource(groups=every, factory=user_optimizer)], {}
    if user_optimizer is not None:
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, a list of them (each on its own "
            "parameters), a callable(param_groups) -> Optimizer, or None (the config's "
            f"'optimizer' block); got {type(user_optimizer).__name__}"
        )
    if config_optimizer is None:
        raise ConfigError(
            "no optimizer: add an 'optimizer' block to the config (e.g. "
            '{"type": "AdamW", "params": {"lr": 1e-3}}) or pass optimizer= to zerodp.initialize'
        )
    if config_optimizer.type == "Muon":
        return split_for_muon(specs, names, config_optimizer.params)
    class_name, kwargs = config_optimizer.torch_kwargs()
    if (
        prefer_fused
        and class_name in _FUSED
        and kwargs.get("fused") is None
        and kwargs.get("foreach") is None
    ):
        kwargs = {**kwargs, "fused": True}
    source = OptimizerSource(groups=every, cls=_optimizer_class(class_name), kwargs=kwargs)
    return specs, [source], {}


def _optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """A config optimizer's class: torch's, or zerodp's Adam without bias correction."""
    if name == UNCORRECTED_ADAM:
        return UncorrectedAdam
    optimizer_class: type[torch.optim.Optimizer] = getattr(torch.optim, name)
    return optimizer_class
