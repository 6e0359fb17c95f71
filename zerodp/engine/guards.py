"""Refusing the wrong path: a managed model wrapped in DDP or FSDP, or stepped by another optimizer.

The usual ways to train a model (wrap it in DistributedDataParallel, give its
parameters to a torch optimizer, as the Hugging Face Trainer and Accelerate do)
would train a model zerodp manages wrong without a word: both would reduce
the same gradients, and a second optimizer would step parameters whose
gradients zerodp keeps elsewhere. Each is refused when it happens, with a
message that names what to use instead:

- wrapping in DDP: DDP's constructor reads `_ddp_params_and_buffers_to_ignore`
  from the module; the engine leaves a value there whose iteration raises, so
  the error comes from the `DistributedDataParallel(model)` line itself;
- FSDP, FSDP2, or DDP by another route: the first forward through the wrapper;
- another optimizer: its first `step()` (a global step pre-hook of torch.optim,
  installed once), before it changes anything;
- parameters added to the module after `initialize` (`peft.get_peft_model` on
  the engine's model, a new head): the next forward, since the engine would
  neither reduce their gradients nor step them. Counting a model's parameters
  walks every module, so a forward recounts only after a parameter or a module
  was registered somewhere in the process since the last count (two global
  registration hooks count them); a forward of an unchanged model costs one
  integer comparison.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zerodp.comm.data_parallel_wrappers import fully_sharded_by_fsdp2, wrapper_calling
from zerodp.errors import UsageError
from zerodp.full_state.param_managers import manager_of

_INSTEAD = (
    "zerodp does the data parallelism itself: train through the engine (engine(batch), "
    "engine.backward(loss), engine.step()), or use zerodp.integrations.transformers."
    "ZeroDPTrainer for the Hugging Face Trainer, or the Accelerate recipe in docs/integrations.md"
)
DDP_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"


class RefuseDDP:
    """What a managed module holds under the attribute DDP's constructor reads."""

    def __iter__(self) -> Any:
        raise UsageError(f"this model is managed by zerodp; do not wrap it in DDP: {_INSTEAD}")

    def __reduce__(self) -> Any:
        return (RefuseDDP, ())


class ModuleGuard:
    """The guards on one managed module; `remove()` undoes them (at `engine.destroy()`)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._had = DDP_ATTRIBUTE in module.__dict__
        self._previous = module.__dict__.get(DDP_ATTRIBUTE)
        module.__dict__[DDP_ATTRIBUTE] = RefuseDDP()
        _install_registration_counter()
        self._num_params = _num_params(module)
        self._counted_at = _REGISTRATIONS[0]
        _install_optimizer_check()

    def check_forward(self) -> None:
        """Called at the start of every forward of the managed root module."""
        wrapper = wrapper_calling()
        if wrapper is None and fully_sharded_by_fsdp2(self.module):
            wrapper = "fully_shard (FSDP2)"
        if wrapper is not None:
            raise UsageError(
                f"this model is managed by zerodp and was wrapped in {wrapper}: {_INSTEAD}"
            )
        if _REGISTRATIONS[0] == self._counted_at:
            return  # nothing was registered anywhere since the last count
        self._counted_at = _REGISTRATIONS[0]
        num_params = _num_params(self.module)
        if num_params != self._num_params:
            raise UsageError(
                f"the model had {self._num_params} parameters at zerodp.initialize and has "
                f"{num_params} now; the engine would neither reduce nor step the new ones. "
                "Add adapters (peft.get_peft_model) or new layers before zerodp.initialize, "
                "or engine.destroy() and initialize again"
            )

    def remove(self) -> None:
        if self._had:
            self.module.__dict__[DDP_ATTRIBUTE] = self._previous
        else:
            self.module.__dict__.pop(DDP_ATTRIBUTE, None)


def _num_params(module: nn.Module) -> int:
    return sum(1 for _ in module.parameters())


# Parameters and modules registered on any module of the process (`register_parameter`,
# `add_module`, and attribute assignment, which calls them), counted once hooks are installed.
_REGISTRATIONS = [0]
_REGISTRATION_HOOKS: list[Any] = []


def _count_registration(module: nn.Module, name: str, value: Any) -> None:
    _REGISTRATIONS[0] += 1


def _install_registration_counter() -> None:
    if not _REGISTRATION_HOOKS:
        _REGISTRATION_HOOKS.append(register_module_parameter_registration_hook(_count_registration))
        _REGISTRATION_HOOKS.append(register_module_module_registration_hook(_count_registration))


# Optimizers zerodp steps itself (its own, and the torch optimizers inside), and optimizers
# already checked: each is looked at once.
_OWN_OPTIMIZERS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_HOOK: list[Any] = []


def mark_own_optimizer(optimizer: torch.optim.Optimizer) -> None:
    _OWN_OPTIMIZERS.add(optimizer)


def _install_optimizer_check() -> None:
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _OWN_OPTIMIZERS or optimizer in _CHECKED:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if manager_of(param) is not None:
                raise UsageError(
                    f"a {type(optimizer).__name__} was given parameters that a zerodp engine "
                    "manages; zerodp keeps their gradients and steps them itself, so this "
                    "optimizer would step them with no gradient: use the optimizer "
                    f"zerodp.initialize returns (engine.optimizer) instead. {_INSTEAD}"
                )
    _CHECKED.add(optimizer)
