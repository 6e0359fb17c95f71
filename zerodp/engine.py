"""The engine users hold: a facade that wires zerodp's parts together.

It owns no collective, layout or stage logic: the stage strategy decides,
`partition` lays out, `backward` reduces, `params` gathers (stage 3), `optim`
steps. The engine keeps DeepSpeed's surface (`backward`, `step`,
`zero_grad`, counters) and the explicit gradient state that `step()` checks.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp import registry
from zerodp.accessors import FullStateAccessor
from zerodp.assembly import assemble
from zerodp.backward import autograd_api
from zerodp.backward.hooks import install_parameter_hooks, install_root_hooks
from zerodp.backward.lifecycle import BackwardLifecycle, GraphTask
from zerodp.checkpoint.engine_io import load_checkpoint, save_checkpoint
from zerodp.comm import Comm, default_device, ensure_process_group
from zerodp.comm.group import local_rank
from zerodp.config import ZeroDPConfig
from zerodp.data import ZeroDataLoader
from zerodp.errors import LifecycleError
from zerodp.monitor.eigenvalue import EigenvalueMonitor
from zerodp.monitor.events import eigenvalue_event_name
from zerodp.monitor.memory import ModelStateBytes, engine_model_state_bytes
from zerodp.monitor.sinks import Monitor
from zerodp.monitor.training import TrainingReporter
from zerodp.optim.param_groups import resolve_param_groups
from zerodp.optim.schedulers import build_scheduler
from zerodp.optim.sharded_optimizer import ZeroOptimizer
from zerodp.optim.strategy import strategy_for
from zerodp.params.status import ParamStatus
from zerodp.partition import FlatGroup
from zerodp.precision import loss_scaler_from_config, precision_policy
from zerodp.precision.inputs import install_input_cast

logger = logging.getLogger("zerodp")


class GradientState(enum.Enum):
    """What the gradients zerodp keeps hold, as far as `step()` is concerned."""

    CLEAN = "clean"  # zeroed, no backward since
    ACCUMULATED = "accumulated"  # every backward since zero_grad() finished
    INCOMPLETE = "incomplete"  # a backward raised part-way; zero_grad() needed


class ZeroEngine:
    """What `zerodp.initialize` returns: the model wrapped for ZeRO training.

    Call it like the model (`engine(batch)`), then `engine.backward(loss)` (or
    any other way of running backward) and `engine.step()` once per micro-batch.
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        config: ZeroDPConfig,
        model_parameters: Iterable[Any] | None = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        ensure_process_group()
        self.config = config
        self.comm = Comm()
        self.device = default_device()
        self.strategy = strategy_for(config.zero_optimization.stage)
        self.precision = precision_policy(config)
        self.module = module
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.gradient_state = GradientState.CLEAN
        self.lifecycle = BackwardLifecycle()
        self._handles: list[RemovableHandle] = []
        self._destroyed = False
        self._scaled_loss_pending = False  # scale() was called; the next task's loss is scaled

        specs = resolve_param_groups(module, model_parameters, optimizer)
        state = assemble(
            module,
            config,
            comm=self.comm,
            device=self.device,
            strategy=self.strategy,
            policy=self.precision,
            lifecycle=self.lifecycle,
            specs=specs,
            user_optimizer=optimizer,
        )
        self.layout = state.layout
        self.stage3 = state.stage3
        self.reducer = state.reducer
        self.masters = state.masters
        self._managed_params = state.managed_params
        self._handles += install_parameter_hooks(
            state.trainable_params, self.lifecycle, self.reducer
        )
        self._handles += install_root_hooks(module, self.lifecycle, self._on_forward_start)
        if self.precision.mixed:
            self._handles.append(install_input_cast(module, self.precision.param_dtype))
        self._handles += [
            self.lifecycle.on_prologue(self._prologue),
            self.lifecycle.on_epilogue(self._epilogue),
            self.lifecycle.on_abort(self._abort),
        ]
        inner = state.inner_optimizer
        self.optimizer = ZeroOptimizer(
            inner,
            reducer=self.reducer,
            comm=self.comm,
            shards=state.shards,
            sharded_grads=self.strategy.shards_optimizer_state,
            resident_groups=self._resident_groups,
            model_params=self._managed_params,
            gradient_clipping=config.gradient_clipping,
            before_step=self._check_can_step,
            on_zero_grad=self.zero_grad,
            loss_scaler=loss_scaler_from_config(config.fp16),
            masters=self.masters,
        )
        self.full_state = FullStateAccessor(
            comm=self.comm,
            reducer=self.reducer,
            groups=self.layout.groups,
            shard_params={id(grads.group): shard for grads, shard in state.shards},
            optimizer=inner,
            owns_full_group=self.strategy.reduction.optimizer_owns_full_group,
            stage3=self.stage3,
            masters=self.masters,
            loss_scale=lambda: self.optimizer.loss_scaler.scale,
        )
        self.lr_scheduler = self._make_scheduler(lr_scheduler, inner)
        self.reporter = TrainingReporter(
            Monitor.from_config(config.csv_monitor, config.tensorboard, rank=self.comm.rank),
            active=config.csv_monitor.enabled or config.tensorboard.enabled,
            comm=self.comm,
        )
        self.eigenvalue = (
            EigenvalueMonitor(config.eigenvalue, module, self.comm)
            if config.eigenvalue.enabled
            else None
        )
        self.block_eigenvalue: dict[int, float] = {}  # the latest estimate, per block
        self._eigenvalue_pending = False
        self.training_dataloader = None
        if training_data is not None:
            self.training_dataloader = ZeroDataLoader(
                training_data,
                micro_batch_size=config.batch_sizes.train_micro_batch_size_per_gpu,
                rank=self.comm.rank,
                world_size=self.comm.world_size,
                collate_fn=collate_fn,
                drop_last=config.dataloader_drop_last,
                seed=config.seed or 0,
            )
        registry.register(self, self._managed_params)

    # -- set-up helpers ------------------------------------------------------------------

    def _make_scheduler(self, lr_scheduler: Any, inner: torch.optim.Optimizer) -> Any:
        if lr_scheduler is None:
            if self.config.scheduler is None:
                return None
            return build_scheduler(self.optimizer, self.config.scheduler)
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            if lr_scheduler.optimizer is not inner and lr_scheduler.optimizer is not self.optimizer:
                raise ValueError(
                    "lr_scheduler is bound to an optimizer zerodp does not step; pass the "
                    "optimizer it was built on to zerodp.initialize too, or pass a callable "
                    "lr_scheduler(optimizer) -> scheduler"
                )
            return lr_scheduler
        if callable(lr_scheduler):
            return lr_scheduler(self.optimizer)
        raise TypeError("lr_scheduler must be an LRScheduler, a callable(optimizer), or None")

    def _resident_groups(self) -> list[FlatGroup]:
        if not self.strategy.gathers_params_after_step:
            return []
        if self.stage3 is not None:
            return self.stage3.resident_groups()
        return [g for g in self.layout.groups if g.trainable]

    # -- lifecycle callbacks -------------------------------------------------------------

    def _on_forward_start(self) -> None:
        if not autograd_api.in_backward():
            self._abort_stale_backward()

    def _prologue(self, task: GraphTask) -> None:
        # A backward whose loss went through scale() carries the fp16 loss scale; any
        # other (a plain loss.backward()) gets it applied to its gradients instead.
        loss_scale = self.optimizer.loss_scaler.scale
        unscaled = not self._scaled_loss_pending and loss_scale != 1.0
        self._scaled_loss_pending = False
        self.reducer.begin_task(
            is_boundary=self.is_gradient_accumulation_boundary(),
            contribution_scale=loss_scale if unscaled else 1.0,
        )

    def _epilogue(self, task: GraphTask) -> None:
        self.reducer.end_task()
        if self.gradient_state is GradientState.CLEAN:
            self.gradient_state = GradientState.ACCUMULATED

    def _abort(self, task: GraphTask) -> None:
        self.reducer.abort_task()
        self.gradient_state = GradientState.INCOMPLETE

    def _abort_stale_backward(self) -> None:
        self.lifecycle.abort_if_stale()

    def _check_can_step(self) -> None:
        self._abort_stale_backward()
        if autograd_api.in_backward():
            raise LifecycleError(
                "step() was called inside a backward (from a hook?); call it after "
                "backward has returned"
            )
        if self.gradient_state is GradientState.INCOMPLETE:
            raise LifecycleError(
                "a backward raised part-way, so the gradients are incomplete; call "
                "engine.zero_grad() and run the backward again before step()"
            )

    # -- the training surface ----------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    forward = __call__

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as backward should see it: divided by the accumulation steps, and
        multiplied by the fp16 loss scale (the optimizer step divides it out again)."""
        gas = self.gradient_accumulation_steps()
        factor = self.optimizer.loss_scaler.scale / gas
        self._scaled_loss_pending = True
        return loss * factor if factor != 1.0 else loss

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, **kwargs: Any
    ) -> torch.Tensor:
        self._abort_stale_backward()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"engine.backward expects a tensor loss, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(
                f"engine.backward needs a scalar loss, got shape {tuple(loss.shape)}; reduce it "
                "first (e.g. loss.mean()), or call loss.backward(gradient) yourself"
            )
        if not loss.requires_grad:
            raise ValueError(
                "the loss does not require grad: it was computed without autograd "
                "(under torch.no_grad(), or from frozen parameters only)"
            )
        self.reporter.record_loss(loss)
        eigen = self.eigenvalue
        if eigen is not None and eigen.due(
            self.global_steps, self.is_gradient_accumulation_boundary()
        ):
            # Double backward through the model before the backward frees its graph.
            values = eigen.compute(loss, seed=self.global_steps)
            self.block_eigenvalue = dict(enumerate(values))
            self._eigenvalue_pending = True
        try:
            self.scale(loss).backward(retain_graph=retain_graph, **kwargs)
        except BaseException:
            self._abort_stale_backward()
            raise
        return loss

    def _eigenvalue_events(self) -> list[tuple[str, float, int]]:
        if not self._eigenvalue_pending:
            return []
        self._eigenvalue_pending = False
        return [
            (eigenvalue_event_name(block), value, self.global_samples)
            for block, value in self.block_eigenvalue.items()
        ]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient zerodp keeps (its buffers stay allocated for the next step)."""
        self._abort_stale_backward()
        if autograd_api.in_backward():
            raise LifecycleError("zero_grad() was called inside a backward; call it outside")
        self.reducer.zero()
        if self.stage3 is not None:
            # Groups a forward kept gathered for its backward go too (it may never come).
            self.stage3.coordinator.release_all()
        self.gradient_state = GradientState.CLEAN

    def step(self) -> None:
        """At an accumulation boundary: optimizer and scheduler step, then zero_grad().

        Between boundaries it only counts the micro-step. Zeroing after the
        boundary step follows DeepSpeed; within an accumulation window,
        gradients add up across every backward until then, as in PyTorch.
        """
        self._check_can_step()
        if self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            if self.lr_scheduler is not None and not self.optimizer.last_step_skipped:
                self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.reporter.on_boundary(self, self._eigenvalue_events())
            self.zero_grad()
            if self.global_steps % self.config.steps_per_print == 0 and self.global_rank == 0:
                logger.info("step %d: lr %s", self.global_steps, self.get_lr())
        self.micro_steps += 1

    # -- accessors DeepSpeed users reach for ------------------------------------------------

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        return local_rank()

    @property
    def zero_stage(self) -> int:
        return self.strategy.stage

    def gradient_accumulation_steps(self) -> int:
        return self.config.batch_sizes.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch_sizes.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.batch_sizes.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.optimizer.loss_scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients overflowed (fp16)."""
        return self.optimizer.skipped_steps

    def get_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step (before clipping), over all ranks."""
        norm = self.optimizer.last_grad_norm
        return None if norm is None else float(norm.item())

    def register_backward_hooks(
        self,
        prologue: Callable[[GraphTask], None] | None = None,
        epilogue: Callable[[GraphTask], None] | None = None,
    ) -> list[RemovableHandle]:
        """Run `prologue` when each backward graph task starts and `epilogue` when it ends.

        One call each per graph task, however backward was called; see
        [Note: backward lifecycle]. Returns handles whose `remove()` unregisters.
        """
        return self.lifecycle.register_user_hooks(prologue, epilogue)

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        self.module.eval()
        return self

    def save_checkpoint(
        self, save_dir: Any, tag: str | None = None, client_state: Any = None
    ) -> str:
        """Save everything needed to resume, sharded, with torch.distributed.checkpoint.

        A collective: every rank calls it. Written under a temporary name and made
        visible (renamed, then `latest` updated) only once every rank has finished.
        Returns the checkpoint's path. See zerodp.checkpoint for the format.
        """
        return str(save_checkpoint(self, save_dir, tag=tag, client_state=client_state))

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, Any]:
        """Load a checkpoint saved at any stage and world size; returns (path, client_state).

        With no tag and no `latest` file in `load_dir` (nothing saved yet), nothing is
        loaded and (None, None) is returned, as in DeepSpeed.
        """
        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )

    def optimizer_extra_state(self) -> list[torch.Tensor]:
        """Optimizer-side tensors outside the torch optimizer's state (fp32 master weights)."""
        return self.masters.tensors() if self.masters is not None else []

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes this rank holds in parameters, gradients and optimizer state."""
        return engine_model_state_bytes(self)

    def param_status(self, param: nn.Parameter) -> ParamStatus:
        self._abort_stale_backward()
        if self.stage3 is None:
            return ParamStatus.AVAILABLE
        return self.stage3.coordinator.status(param)

    def destroy(self) -> None:
        """Remove every hook and free zerodp's buffers; the module stays usable."""
        if self._destroyed:
            return
        self._abort_stale_backward()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.stage3 is not None:
            self.stage3.teardown()
        for param in self._managed_params:
            param.grad = None
        registry.unregister(self._managed_params)
        self.reporter.close()
        self.reducer.groups = []
        self._destroyed = True
