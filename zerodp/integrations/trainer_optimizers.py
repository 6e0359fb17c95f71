"""Which optimizer and LR scheduler the engine builds for a `ZeroDPTrainer`.

The Trainer would build both on the model's parameters; zerodp builds them on
what it steps (flat shards, or whole tensors for an optimizer that reads
them), at `train()`. In order of precedence: the config's "optimizer" /
"scheduler" block, else what was passed as `optimizers=(optimizer,
lr_scheduler)`, else the one the TrainingArguments name (`args.optim` with the
Trainer's weight-decay groups, `args.lr_scheduler_type`). See [Note: what
ZeroDPTrainer takes over] in `zerodp.integrations.transformers`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Trainer

import zerodp
from zerodp.errors import ConfigError, UsageError

# Schedulers the Trainer steps with a metric after evaluation; the engine steps without one.
_METRIC_SCHEDULERS = frozenset({"reduce_lr_on_plateau", "greedy"})
# Optimizers that update inside backward (LOMO) and cannot step flat shards.
_UNSUPPORTED_OPTIM = frozenset({"lomo", "adalomo"})


def _name(choice: Any) -> str:
    """The string of a TrainingArguments choice (an enum member or a plain string)."""
    return str(getattr(choice, "value", choice))


class TrainerOptimizers(Trainer):
    """`ZeroDPTrainer`'s optimizer and scheduler choice: what `zerodp.initialize` is given."""

    # Provided by ZeroDPTrainer.
    engine: zerodp.ZeroEngine | None
    _given_optimizer: Any  # optimizers=(optimizer, ...) as the Trainer was given it
    _given_scheduler: Any  # optimizers=(..., lr_scheduler)

    def _module(self) -> nn.Module:
        raise NotImplementedError  # ZeroDPTrainer's

    def _engine_optimizer(self, config: dict[str, Any]) -> tuple[Any, Any]:
        """(optimizer= , model_parameters=) for zerodp.initialize."""
        given = self._given_optimizer
        if "optimizer" in config:
            if given is not None:
                raise ConfigError(
                    "zerodp_config has an 'optimizer' block and the Trainer was given "
                    "optimizers=(optimizer, ...): remove one of them"
                )
            return None, None
        if given is not None:
            return given, None
        if _name(self.args.optim) in _UNSUPPORTED_OPTIM:
            raise ConfigError(
                f"optim={_name(self.args.optim)!r} updates the weights inside backward, which "
                "zerodp cannot do on sharded parameters; use adamw_torch or an 'optimizer' block"
            )
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)  # type: ignore[arg-type]
        builds_own_groups = {"params", "model", "optimizer_dict"} & set(kwargs)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or (
            builds_own_groups
        ):
            raise ConfigError(
                f"optim={_name(self.args.optim)!r} builds its own parameter groups or several "
                "optimizers, which zerodp cannot lay out; use a torch optimizer (adamw_torch, "
                "adafactor, sgd, ...) or an 'optimizer' block in zerodp_config (\"Muon\" too)"
            )
        kwargs = dict(kwargs)

        def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            return cls(groups, **kwargs)

        return build, self._weight_decay_groups()

    def _weight_decay_groups(self) -> list[dict[str, Any]]:
        """The Trainer's two param groups: weight decay, and none for biases and norms."""
        model = self._module()
        decay = set(self.get_decay_parameter_names(model))
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {
                "params": [p for n, p in trainable if n in decay],
                "weight_decay": self.args.weight_decay,
            },
            {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
        ]
        return [group for group in groups if group["params"]]

    def _engine_scheduler(self, config: dict[str, Any], num_training_steps: int) -> Any:
        """lr_scheduler= for zerodp.initialize: None for the config's block, else a scheduler."""
        if "scheduler" in config:
            if self._given_scheduler is not None:
                raise ConfigError(
                    "zerodp_config has a 'scheduler' block and the Trainer was given "
                    "optimizers=(..., lr_scheduler): remove one of them"
                )
            return None
        if self._given_scheduler is not None:
            return self._given_scheduler
        if _name(self.args.lr_scheduler_type) in _METRIC_SCHEDULERS:
            raise ConfigError(
                f"lr_scheduler_type={_name(self.args.lr_scheduler_type)!r} steps on an evaluation "
                "metric, which the engine's step does not have; use another schedule"
            )

        def build(optimizer: torch.optim.Optimizer) -> Any:
            # On the torch optimizer inside zerodp's: the engine calls its step(), so torch's
            # "lr_scheduler.step() before optimizer.step()" check sees the steps.
            inner = getattr(optimizer, "inner", optimizer)
            self.lr_scheduler = None  # create_scheduler builds only when there is none
            return self.create_scheduler(num_training_steps, optimizer=inner)

        return build

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        """The engine's optimizer view; zerodp builds the optimizer itself, at train()."""
        if self.engine is None:
            raise UsageError(
                "ZeroDPTrainer builds its optimizer inside zerodp at train(); pass "
                "optimizers=(...) or an 'optimizer' block in zerodp_config to choose it"
            )
        return self.optimizer
