"""`ZeroDPStrategy`: Lightning's `Trainer.fit` with a zerodp engine doing each training step.

    trainer = lightning.Trainer(accelerator="cpu", devices=2, accumulate_grad_batches=2,
                                strategy=ZeroDPStrategy({"zero_optimization": {"stage": 3}}))
    trainer.fit(module, loader)          # torchrun --nproc_per_node 2, or let Lightning launch

Needs `pip install 'zerodp[lightning]'`. Process groups, launching, samplers
and collectives are Lightning's DDP strategy's; the model is never wrapped in
DDP. What works, and is tested against Lightning's own single-process run:

- automatic optimization with one optimizer from `configure_optimizers`
  (zerodp steps it on its shards) and its LR schedulers (Lightning steps them,
  per step or per epoch, as it always does);
- `accumulate_grad_batches` (the engine's `gradient_accumulation_steps`) and
  `gradient_clip_val` with the "norm" algorithm (the engine's `gradient_clipping`);
  the loss `training_step` returns goes through `engine.backward`, and the
  engine steps in the optimizer step Lightning calls;
- stages 0-3, and bf16/fp16 from the config's blocks (Lightning's precision
  stays "32-true": zerodp casts the model and keeps fp32 master weights);
- checkpoints: `trainer.save_checkpoint(path)` and `ModelCheckpoint` write an
  engine checkpoint *directory* at `path` (Lightning's own state, loops,
  callbacks and schedulers travel as its client state); `fit(ckpt_path=path)`
  resumes from it;
- after `fit` the engine is destroyed and the LightningModule is a plain
  module with the trained weights on every rank (in the training dtype), so
  `validate`, `test`, `predict` and a later `save_checkpoint` are Lightning's
  usual ones.

What does not, with a clear error: manual optimization, several optimizers,
`gradient_clip_algorithm="value"`, Lightning precision plugins other than
"32-true" (use the config's bf16/fp16 blocks).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as _error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "zerodp.integrations.lightning needs Lightning: pip install 'zerodp[lightning]'"
    ) from _error

import zerodp
from zerodp.config.fields import parallel_size
from zerodp.errors import CheckpointError, ConfigError, UsageError
from zerodp.integrations.trainer_config import AUTO, ConfigFiller, mismatch_error, read_config
from zerodp.parallel.composition import Dimension, Feature, refusal
from zerodp.torch_internals import init_optimizer_hook_dicts

__all__ = ["ZeroDPStrategy"]

_WEIGHT_KEYS = ("state_dict", "optimizer_states")


class ZeroDPStrategy(DDPStrategy):
    """Lightning's DDP strategy without the DDP wrapper: a zerodp engine trains the module.

    `config` is a zerodp (DeepSpeed-style) config, a dict or a JSON path.
    "auto" (or absent) batch keys come from the Trainer: the micro batch from
    the train loader's `batch_size`, the accumulation steps from
    `accumulate_grad_batches`, `gradient_clipping` from `gradient_clip_val`.
    Other keyword arguments go to `DDPStrategy` (cluster environment,
    process group backend, timeout, start method).
    """

    strategy_name = "zerodp"

    def __init__(self, config: Any, **kwargs: Any) -> None:
        data = read_config(config)  # a bad path or type fails here, not in fit()
        refused = refusal(Feature.LIGHTNING, _dimension_sizes(data))
        if refused is not None:
            raise ConfigError(refused)
        super().__init__(**kwargs)
        self.zerodp_config = config
        self.engine: zerodp.ZeroEngine | None = None
        self._stepping = False  # inside the optimizer step Lightning calls (a boundary)

    # -- set-up ---------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)  # validate/test/predict: no gradients, no engine
            return
        module = self.lightning_module
        if module is None:
            raise UsageError("ZeroDPStrategy.setup: no LightningModule is connected")
        _refuse_unsupported(trainer, module, self.precision_plugin)
        if self.accelerator is None:
            raise RuntimeError("internal error: Lightning connected no accelerator before setup")
        self.accelerator.setup(trainer)
        self.model_to_device()
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise UsageError(
                f"configure_optimizers returned {len(self.optimizers)} optimizers; "
                "ZeroDPStrategy trains with exactly one"
            )
        config = lightning_config(self.zerodp_config, trainer)
        if "optimizer" in config:
            raise ConfigError(
                "the config has an 'optimizer' block and configure_optimizers returned an "
                "optimizer: remove the block (zerodp steps configure_optimizers' optimizer)"
            )
        engine, _, _, _ = zerodp.initialize(
            model=module, config=config, optimizer=self.optimizers[0]
        )
        self.engine = engine
        self.model = module
        self.optimizers = [EngineStepOptimizer(engine, self)]

    def _setup_model(self, model: torch.nn.Module) -> Any:
        return model  # never DDP: zerodp reduces the gradients

    # -- the training step ---------------------------------------------------------------

    def _require_engine(self) -> zerodp.ZeroEngine:
        if self.engine is None:
            raise UsageError("the zerodp engine exists only inside trainer.fit()")
        return self.engine

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            return super().training_step(*args, **kwargs)
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self.precision_plugin.train_step_context():
            return _inside_call(self.lightning_module, "training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            return super().validation_step(*args, **kwargs)
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        with self.precision_plugin.val_step_context():
            return _inside_call(self.lightning_module, "validation_step", *args, **kwargs)

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """`engine.backward`, told whether an optimizer step follows this micro-batch.

        Lightning has divided the loss by `accumulate_grad_batches` already. It runs
        the boundary micro-batch inside the optimizer step (`EngineStepOptimizer`)
        and the others outside, where the engine's `step()` only counts them.
        """
        engine = self._require_engine()
        module = self.lightning_module
        if module is None:
            raise RuntimeError("internal error: a backward with no LightningModule connected")
        boundary = self._stepping
        engine.set_gradient_accumulation_boundary(boundary)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        engine.backward(closure_loss, scale_wrt_gas=False)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        if not boundary:
            engine.step()
        return closure_loss

    def run_boundary_step(self, closure: Callable[[], Any] | None) -> Any:
        """The closure (forward and backward of the last micro-batch), then the engine's step."""
        engine = self._require_engine()
        self._stepping = True
        try:
            result = closure() if closure is not None else None
        finally:
            self._stepping = False
        engine.step()
        return result

    def on_train_start(self) -> None:
        """The loader Lightning built must have the batch size the engine counts with."""
        super().on_train_start()
        module = self.lightning_module
        loader = module.trainer.train_dataloader if module is not None else None
        size = getattr(loader, "batch_size", None)
        engine = self.engine
        if (
            engine is not None
            and isinstance(size, int)
            and size != engine.train_micro_batch_size_per_gpu()
        ):
            raise ConfigError(
                f"the train loader's batch_size is {size}, the config's "
                f"train_micro_batch_size_per_gpu {engine.train_micro_batch_size_per_gpu()}; "
                'make them agree (or set the key to "auto")'
            )

    # -- checkpoints ------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load its checkpoint

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self.engine is None  # the engine restores its optimizer itself

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.engine is None:
            return super().lightning_module_state_dict()
        return {}  # the engine's checkpoint holds the weights

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.engine is None:
            return super().optimizer_state(optimizer)
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """An engine checkpoint directory at `filepath`; Lightning's state as client state."""
        if self.engine is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        client_state = {k: v for k, v in checkpoint.items() if k not in _WEIGHT_KEYS}
        self.engine.save_checkpoint(str(filepath), client_state=client_state)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        if self.engine is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        path, client_state = self.engine.load_checkpoint(str(checkpoint_path))
        if path is None or not isinstance(client_state, dict):
            raise CheckpointError(
                f"'{checkpoint_path}' is not a checkpoint ZeroDPStrategy saved (an engine "
                "checkpoint directory with a 'latest' file)"
            )
        return {**client_state, "state_dict": {}, "optimizer_states": []}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self.engine is None:
            super().load_model_state_dict(checkpoint, strict)  # restored with the engine

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self.engine is None:
            super().load_optimizer_state_dict(checkpoint)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and os.path.isdir(filepath):
            shutil.rmtree(filepath)
        else:
            super().remove_checkpoint(filepath)

    def teardown(self) -> None:
        """Destroy the engine: the module is left plain, whole and trained on every rank."""
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
            self.optimizers = []
        super().teardown()


class EngineStepOptimizer(torch.optim.Optimizer):
    """What Lightning steps: `step(closure)` runs the closure, then the engine's boundary step.

    Lightning's precision plugin hands `step` a closure that runs the last
    micro-batch's training_step and backward and then its
    `on_before_optimizer_step` hooks; `param_groups` and `state` are the engine
    optimizer's (this rank's shards), which the LR schedulers from
    configure_optimizers also drive. `Optimizer.__init__` is not called: there
    are no parameters of its own.
    """

    def __init__(self, engine: zerodp.ZeroEngine, strategy: ZeroDPStrategy) -> None:
        self.engine = engine
        self._zerodp_strategy = strategy
        self.defaults = engine.optimizer.defaults
        init_optimizer_hook_dicts(self)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.engine.optimizer.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._zerodp_strategy.run_boundary_step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        raise UsageError("zerodp restores its optimizer from its checkpoint (fit(ckpt_path=...))")


def _inside_call(module: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """`module.<method>(...)` run as `module(...)`, so hooks on the module's forward run.

    Lightning calls training_step directly, but the engine hooks the root
    module's forward: it checks for a backward left unfinished there, and at
    stage 3 begins and ends each forward pass there (saved-tensor hooks that
    keep gathered parameters out of the autograd graph, the prefetch trace).
    """
    had_own = "forward" in module.__dict__
    own = module.__dict__.get("forward")

    def restore() -> None:
        if had_own:
            module.forward = own
        else:
            module.__dict__.pop("forward", None)

    def forward(*inner_args: Any, **inner_kwargs: Any) -> Any:
        restore()  # a forward() the step itself calls is the module's own
        return getattr(module, method)(*inner_args, **inner_kwargs)

    module.forward = forward
    try:
        return module(*args, **kwargs)
    finally:
        restore()


def lightning_config(config: Any, trainer: pl.Trainer) -> dict[str, Any]:
    """The zerodp config for this fit: batch, accumulation and clipping from the Trainer."""
    data = read_config(config)
    mismatches: list[str] = []
    fill = ConfigFiller(data, mismatches)
    micro = data.get("train_micro_batch_size_per_gpu", AUTO)
    if micro == AUTO and data.get("train_batch_size", AUTO) == AUTO:
        data["train_micro_batch_size_per_gpu"] = _train_batch_size(trainer)
    if data.get("train_batch_size") == AUTO:
        del data["train_batch_size"]  # derived from the other two
    fill.match(
        "gradient_accumulation_steps",
        int(trainer.accumulate_grad_batches),
        "Trainer(accumulate_grad_batches)",
    )
    fill.match(
        "gradient_clipping",
        float(trainer.gradient_clip_val or 0.0),
        "Trainer(gradient_clip_val)",
    )
    if mismatches:
        raise mismatch_error("the ZeroDPStrategy config", "the Lightning Trainer", mismatches)
    return data


def _train_batch_size(trainer: pl.Trainer) -> int:
    """The train loader's batch size, read before Lightning sets the loader up.

    Lightning builds its loaders after the strategy's set-up, so this asks the
    same source it will ask (the datamodule's or the module's train_dataloader).
    """
    source = getattr(trainer.fit_loop, "_data_source", None)
    loader = source.dataloader() if source is not None and source.is_defined() else None
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int) or size < 1:
        raise ConfigError(
            "ZeroDPStrategy cannot tell the train loader's batch size (no DataLoader with a "
            "batch_size); set 'train_micro_batch_size_per_gpu' in the config"
        )
    return size


def _refuse_unsupported(trainer: pl.Trainer, module: pl.LightningModule, precision: Any) -> None:
    problems = []
    if not module.automatic_optimization:
        problems.append("manual optimization (automatic_optimization=False)")
    algorithm = trainer.gradient_clip_algorithm or "norm"  # None: Lightning's default, norm
    algorithm = str(getattr(algorithm, "value", algorithm))
    if trainer.gradient_clip_val and algorithm != "norm":
        problems.append(
            f"gradient_clip_algorithm={algorithm!r} (zerodp clips by the global norm: use 'norm')"
        )
    if type(precision) is not Precision:
        problems.append(
            f"precision plugin {type(precision).__name__} (leave Trainer(precision='32-true') and "
            'set "bf16": {"enabled": true} or "fp16" in the zerodp config)'
        )
    if problems:
        raise UsageError("ZeroDPStrategy does not support " + "; ".join(problems))


def _dimension_sizes(data: dict[str, Any]) -> dict[Dimension, int]:
    """Every dimension's size as the config wrote it, read before the Trainer fills its
    "auto" keys (so not through the config model, which needs them)."""
    tensor = data.get("tensor_parallel", {})
    expert = data.get("expert_parallel", {})
    expert_on = isinstance(expert, dict) and expert.get("enabled") is True
    return {
        Dimension.SEQUENCE: parallel_size(
            data.get("sequence_parallel_size"), "sequence_parallel_size"
        ),
        Dimension.TENSOR: parallel_size(
            tensor.get("autotp_size") if isinstance(tensor, dict) else None,
            "tensor_parallel.autotp_size",
        ),
        Dimension.EXPERT: parallel_size(
            expert.get("autoep_size") if expert_on else None, "expert_parallel.autoep_size"
        ),
    }
