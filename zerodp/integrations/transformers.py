"""`ZeroDPTrainer` and `with_zerodp`: the HF `Trainer` (or any subclass), zerodp doing the step.

    trainer = ZeroDPTrainer(model=model, args=TrainingArguments(...),
                            train_dataset=dataset, zerodp_config="zero3.json")
    trainer.train()                      # torchrun --nproc_per_node N train.py
    trainer.save_model("out")            # config.json + model.safetensors

    DPO = with_zerodp(trl.DPOTrainer)    # any transformers.Trainer subclass
    DPO(model=policy, ref_model=ref, args=DPOConfig(...), ..., zerodp_config=config)

The Trainer has no plug-in point for an outside engine, so this subclass
takes over the few places where it would prepare, step or save the model
itself ([Note: what ZeroDPTrainer takes over]). Everything else (data
loading through Accelerate, the loop, callbacks, logging, evaluation,
trainer_state.json, RNG state, checkpoint rotation) is the Trainer's own.
`with_zerodp(cls)` slots `ZeroDPTrainer` between `cls` and `Trainer` in the
method resolution order ([Note: with_zerodp's class order]), so a trainer
such as TRL's keeps its own loss, data and generation code while zerodp
prepares, steps and saves; `ZeroDPTrainer` is `with_zerodp(Trainer)`.

[Note: what ZeroDPTrainer takes over]
- Preparation (`_prepare_for_training`): `zerodp.initialize` builds the engine
  on `self.model`, with the config from `trainer_config` (the "auto" values
  and the batch, accumulation and clipping keys from the TrainingArguments).
  The model is never wrapped in DDP nor handed to `accelerator.prepare`
  (zerodp places, casts and shards it, and reduces its gradients).
- The optimizer: the config's "optimizer" block, else an optimizer passed as
  `optimizers=(optimizer, ...)`, else the one `args.optim` names, built by
  zerodp on what it steps (flat shards, or whole tensors for an optimizer
  that reads them, such as `optim="adafactor"`; never on the model's
  parameters), with the Trainer's weight-decay groups. The LR schedule: the config's "scheduler"
  block, else a scheduler passed in, else `args.lr_scheduler_type`'s, built
  on the engine's optimizer. The engine steps both; what the Trainer holds as
  `self.optimizer` / `self.lr_scheduler` are views whose `step()` is the
  engine's boundary step, and a no-op (the engine has stepped it).
- Backward: the Trainer's one call site, `accelerator.backward(loss)`, runs
  `engine.backward(loss, scale_wrt_gas=False)`: the Trainer has divided the
  loss for accumulation already (or normalised it by `num_items_in_batch`).
  Before each micro-batch the engine is told whether the Trainer will step
  after it (`set_gradient_accumulation_boundary`), so a short last window of
  an epoch steps where the Trainer steps; between boundaries `engine.step()`
  only counts the micro-step.
- Clipping is the engine's (`gradient_clipping` from `max_grad_norm`); the
  logged `grad_norm` is `engine.get_global_grad_norm()` (before clipping,
  over all shards), the logged learning rate the one the step used.
- Checkpoints: `engine.save_checkpoint` writes the sharded model, optimizer,
  scheduler and counters inside the Trainer's `checkpoint-N` folder, next to
  the Trainer's trainer_state.json and rng_state files and the HF weights;
  resuming loads it with `engine.load_checkpoint`.
- `save_model`: the full weights gathered with `engine.state_dict()` and
  written by rank 0 with `save_pretrained` (`_write_hf_model`); for a PEFT
  model only the adapter's tensors are gathered, and PEFT writes its files.
- Other models the trainer prepares for evaluation only (a reference or
  reward model: `accelerator.prepare_model(m, evaluation_mode=True)`): at
  stage 3 a frozen zerodp engine shards them as DeepSpeed would
  (`post_training.prepare_frozen_model`); at stages 0-2 Accelerate places them.
- Generation at stage 3: the model's `generate` runs inside
  `engine.gathered_for_generation()` while the engine lives (`GenerationRoute`).

[Note: with_zerodp's class order]
`with_zerodp(cls)` is `class ZeroDP<cls>(cls, ZeroDPTrainer)`, whose method
resolution order is `ZeroDP<cls>, cls, ..., ZeroDPTrainer, Trainer`: the
methods `cls` and its bases override run first and reach zerodp's through
`super()`, exactly where they would reach the Trainer's. TRL's trainers
override `training_step` and `_load_optimizer_and_scheduler` that way. An
override of a method zerodp takes over that does not call `super()` would
bypass the engine (a DDP-style step, a second optimizer), so `with_zerodp`
refuses such a class with a `TypeError` naming the method. The made class's
`__init__` takes `zerodp_config=` before `cls.__init__` runs, since a
subclass's own signature (TRL's `ref_model=`, `reward_funcs=`) does not.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

try:
    from transformers import Trainer
except ImportError as _error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "zerodp.integrations.transformers needs transformers and accelerate: "
        "pip install 'zerodp[transformers]'"
    ) from _error

import zerodp
from zerodp.errors import CheckpointError, ConfigError, ConfigWarning, UsageError
from zerodp.integrations.post_training import PostTrainingParts, refuse_unsupported_post_training
from zerodp.integrations.trainer_config import (
    TrainerValues,
    read_config,
    refuse_unsupported_arguments,
    trainer_config,
)
from zerodp.integrations.trainer_data import trainer_dims
from zerodp.integrations.trainer_factory import SubclassFactory
from zerodp.integrations.trainer_optimizers import TrainerOptimizers
from zerodp.integrations.trainer_saving import TrainerSaving
from zerodp.integrations.trainer_sequence import (
    TrainerSequence,
    refuse_accelerate_parallelism,
    sequence_size_of,
)
from zerodp.integrations.trainer_views import EngineOptimizer, EngineScheduler

# The Trainer's own methods this subclass replaces; without one of them the Trainer would
# prepare, step or save the model itself, so an import against another layout fails here.
_REPLACED = (
    "_prepare_for_training",
    "_move_model_to_device",
    "_clip_grad_norm",
    "_get_grad_norm",
    "_maybe_log_save_evaluate",
    "_save_optimizer_and_scheduler",
    "_save_scaler",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_best_model",
    "_save",
)
_missing = [name for name in _REPLACED if not hasattr(Trainer, name)]
if _missing:  # pragma: no cover - depends on the installed transformers
    import transformers as _transformers

    raise ImportError(
        f"ZeroDPTrainer does not know this transformers.Trainer ({_transformers.__version__}): "
        f"it has no {', '.join(_missing)}; install the transformers version zerodp's tests use "
        "(see pyproject.toml)"
    )

__all__ = ["EngineOptimizer", "EngineScheduler", "ZeroDPTrainer", "with_zerodp"]


class ZeroDPTrainer(TrainerSequence, TrainerOptimizers, TrainerSaving):
    """A `transformers.Trainer` whose model is trained by a zerodp engine.

    Takes the Trainer's arguments plus `zerodp_config`: a DeepSpeed-style
    config (a dict or a JSON path) whose "auto" values are filled from the
    TrainingArguments (see `zerodp.integrations.trainer_config`). Launch with
    torchrun, one process per device. `self.engine` is the `ZeroEngine` once
    `train()` has built it. The optimizer and scheduler it hands zerodp come
    from `TrainerOptimizers`; checkpoints and `save_model` are `TrainerSaving`'s; with
    `"sequence_parallel_size"` in the config, data, counts and loss are `TrainerSequence`'s
    ([Note: the Trainer and sequence parallelism]).
    """

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *rest: Any,
        zerodp_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if zerodp_config is not None or "zerodp_config" not in self.__dict__:
            self._take_zerodp_config(zerodp_config, args)
        self.engine: zerodp.ZeroEngine | None = None
        self._post_training = PostTrainingParts()  # frozen engines, the generation route
        super().__init__(model, args, *rest, **kwargs)
        refuse_unsupported_arguments(self.args)  # also a subclass's default arguments
        if self.args.n_gpu > 1:
            raise UsageError(
                f"this process sees {self.args.n_gpu} GPUs and the Trainer would use "
                "nn.DataParallel; launch one process per GPU with torchrun instead"
            )
        if getattr(self.args, "torch_compile", False) and self.args.process_index == 0:
            warnings.warn(
                "ZeroDPTrainer: TrainingArguments(torch_compile=True) has no effect (Accelerate "
                "compiles the models it prepares, and zerodp's is not one of them)",
                ConfigWarning,
                stacklevel=2,
            )
        # What the user passed as optimizers=(...): handed to zerodp at train().
        self._given_optimizer, self._given_scheduler = self.optimizer, self.lr_scheduler

    def _take_zerodp_config(self, zerodp_config: Any, args: Any) -> None:
        """Check `zerodp_config=` and the TrainingArguments before the Trainer starts anything."""
        if zerodp_config is None:
            raise ConfigError(
                f"{type(self).__name__} needs zerodp_config= (a dict or the path of a JSON "
                'config, e.g. {"zero_optimization": {"stage": 3}}, with "auto" where the '
                "TrainingArguments decide)"
            )
        data = read_config(zerodp_config)  # a bad path or type fails now, not at train()
        refuse_unsupported_arguments(args)
        refuse_accelerate_parallelism(
            getattr(args, "parallelism_config", None), "TrainingArguments"
        )
        self.zerodp_config = zerodp_config
        self._sequence_size = sequence_size_of(data)
        self._in_sequence_loss = False

    # -- what the Trainer would otherwise do to the model --------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's Accelerator, with backward and model preparation routed to zerodp.

        The Trainer calls `accelerator.backward(loss)` for every micro-batch and
        `accelerator.prepare_model(model)` before evaluating; these two instance
        attributes are the only seams it has for an outside engine.
        """
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        self._data_ranks = trainer_dims(
            self.zerodp_config, self.args.world_size, self.args.process_index, self._sequence_size
        )
        prepare_model = accelerator.prepare_model

        def prepare_model_unless_ours(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
            if model is self.model and self.engine is not None:
                return model  # zerodp placed and cast it: no DDP, no autocast wrapper
            if kwargs.get("evaluation_mode") and model is not self.model:
                config = self._filled_config(max(self.args.max_steps, 0))
                if self._post_training.prepare_frozen(model, config):
                    return model  # stage 3: sharded by a frozen engine
            return prepare_model(model, *args, **kwargs)

        accelerator.prepare_model = prepare_model_unless_ours
        accelerator.backward = self._engine_backward
        self._shard_loaders_by_data_rank()  # a tensor or sequence group shares its batches

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """zerodp moves the model to its device (and keeps stage 3 parameters sharded)."""

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> tuple[nn.Module, Any]:
        """Build the engine (instead of the Trainer's optimizer, scheduler and DDP wrapper)."""
        if self.engine is not None:  # train() again: a fresh engine on the same model
            self._post_training.unroute_generation()
            self.engine.destroy()
            self.engine = None
        config = self._filled_config(max_steps)
        refuse_unsupported_post_training(self.args, config)
        optimizer, model_parameters = self._engine_optimizer(config)
        lr_scheduler = self._engine_scheduler(config, max_steps)
        model = self._module()
        engine, _, _, _ = zerodp.initialize(
            model=model,
            config=config,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=lr_scheduler,
        )
        self.engine = engine
        self.model_wrapped = model
        self._post_training.route_generation(model, engine, self.args)
        stepper = EngineOptimizer(engine)
        # Views, not torch objects: the Trainer only calls step(), zero_grad() and get_last_lr().
        self.optimizer = stepper  # type: ignore[assignment]
        self.lr_scheduler = EngineScheduler(stepper)  # type: ignore[assignment]
        if resume_from_checkpoint is not None:
            path, _ = engine.load_checkpoint(resume_from_checkpoint)
            if path is None:
                raise CheckpointError(
                    f"'{resume_from_checkpoint}' holds no zerodp checkpoint (no 'latest' file): "
                    "it was saved with save_only_model=True or by another engine; resume from "
                    "a checkpoint ZeroDPTrainer saved"
                )
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _filled_config(self, num_training_steps: int) -> dict[str, Any]:
        """The zerodp config with its "auto" values from the TrainingArguments."""
        values = TrainerValues.from_args(
            self.args, num_training_steps=num_training_steps, world_size=self._data_ranks.data_size
        )
        return trainer_config(self.zerodp_config, values)

    def _module(self) -> nn.Module:
        if self.model is None:
            raise UsageError("ZeroDPTrainer has no model: pass model= or model_init=")
        return self.model

    # -- the training step -----------------------------------------------------------

    def _require_engine(self) -> zerodp.ZeroEngine:
        if self.engine is None:
            raise UsageError("the zerodp engine is built by train(); call trainer.train() first")
        return self.engine

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """One micro-batch: the Trainer's forward and loss, backward through the engine."""
        engine = self._require_engine()
        boundary = bool(self.accelerator.sync_gradients)
        engine.set_gradient_accumulation_boundary(boundary)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not boundary:
            engine.step()  # counts the micro-step; the boundary's is the Trainer's optimizer.step()
        return loss

    def _engine_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs:
            raise UsageError(
                f"ZeroDPTrainer's backward got {sorted(kwargs)}, which zerodp does not take"
            )
        # The Trainer divided the loss for accumulation (or by num_items_in_batch) already.
        self._require_engine().backward(loss, scale_wrt_gas=False)

    def _clip_grad_norm(self, model: nn.Module) -> None:
        """The engine clips at its step (`gradient_clipping`, from `max_grad_norm`)."""
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        """Known only after the engine's step: read in `_maybe_log_save_evaluate`."""
        return None

    def _maybe_log_save_evaluate(
        self, tr_loss: Any, grad_norm: Any, *args: Any, **kwargs: Any
    ) -> None:
        norm = self.engine.get_global_grad_norm() if self.engine is not None else grad_norm
        super()._maybe_log_save_evaluate(tr_loss, norm, *args, **kwargs)

    @property
    def frozen_engines(self) -> tuple[zerodp.ZeroEngine, ...]:
        """The frozen engines of the models this trainer prepared for evaluation (stage 3)."""
        return tuple(self._post_training.frozen_engines)

    def destroy_engines(self) -> None:
        """Destroy the training engine and the frozen ones; the models stay, with their weights.

        For a process that goes on to build other engines on the same models; the
        policy's `generate` is its own again.
        """
        self._post_training.destroy()
        if self.engine is not None:
            self.engine.destroy()
        self.engine = None


# -- any Trainer subclass ---------------------------------------------------------------------

# What ZeroDPTrainer defines in place of the Trainer's: a subclass's override of one of these
# must reach zerodp's through super() ([Note: with_zerodp's class order]).
_TAKEN_OVER = (
    *_REPLACED,
    "create_accelerator_and_postprocess",
    "create_optimizer",
    "training_step",
    "save_model",
)
# Run outermost in the made class, around the subclass's own (TRL's compute_loss does not call
# super()): see [Note: the Trainer and sequence parallelism].
_OUTERMOST = ("compute_loss",)
_classes = SubclassFactory(Trainer, ZeroDPTrainer, _TAKEN_OVER, outermost=_OUTERMOST)


def with_zerodp(trainer_class: type[Trainer]) -> type[ZeroDPTrainer]:
    """`trainer_class` with zerodp preparing, stepping and saving its model.

    For any `transformers.Trainer` subclass (TRL's `SFTTrainer`,
    `DPOTrainer`, `GRPOTrainer`, one of your own): the class returned takes
    the same arguments plus `zerodp_config=`, as `ZeroDPTrainer` does, and is
    the same class on every call. `with_zerodp(Trainer)` is `ZeroDPTrainer`.
    See [Note: with_zerodp's class order].
    """
    return _classes.subclass(trainer_class)
