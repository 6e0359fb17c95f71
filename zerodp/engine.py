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
from zerodp.backward import autograd_api
from zerodp.backward.hooks import install_parameter_hooks, install_root_hooks
from zerodp.backward.lifecycle import BackwardLifecycle, GraphTask
from zerodp.backward.reducer import GradientReducer
from zerodp.comm import Comm, broadcast_tensors, default_device, ensure_process_group
from zerodp.comm.group import local_rank
from zerodp.config import ZeroDPConfig
from zerodp.data import ZeroDataLoader
from zerodp.errors import LifecycleError
from zerodp.monitor.memory import ModelStateBytes, engine_model_state_bytes
from zerodp.optim.factory import build_optimizer, shard_parameter
from zerodp.optim.param_groups import resolve_param_groups
from zerodp.optim.schedulers import build_scheduler
from zerodp.optim.sharded_optimizer import ZeroOptimizer
from zerodp.optim.strategy import strategy_for
from zerodp.params.init import adopt_init_groups
from zerodp.params.runtime import Stage3Runtime
from zerodp.params.status import ParamStatus
from zerodp.partition import FlatGroup
from zerodp.partition.builder import build_layout

logger = logging.getLogger("zerodp")


class GradientState(enum.Enum):
    """What the gradients zerodp keeps hold, as far as `step()` is concerned."""

    CLEAN = "clean"  # zeroed, no backward since
    ACCUMULATED = "accumulated"  # every backward since zero_grad() finished
    INCOMPLETE = "incomplete"  # a backward raised part-way; zero_grad() needed


class ZeroEngine:
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
        self.module = module
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.gradient_state = GradientState.CLEAN
        self.lifecycle = BackwardLifecycle()
        self._handles: list[RemovableHandle] = []
        self._destroyed = False

        specs = resolve_param_groups(module, model_parameters, optimizer)
        trainable_groups = {id(p): i for i, spec in enumerate(specs) for p in spec.params}
        zero = config.zero_optimization
        presharded = adopt_init_groups(
            module,
            trainable_groups,
            keep_sharded=self.strategy.shards_params,
            persistence_threshold=zero.stage3_param_persistence_threshold,
        )
        self.layout = build_layout(
            module,
            trainable_groups,
            shard_params=self.strategy.shards_params,
            world_size=self.comm.world_size,
            rank=self.comm.rank,
            device=self.device,
            bucket_numel=zero.reduce_bucket_size,
            persistence_threshold=zero.stage3_param_persistence_threshold,
            presharded=presharded,
        )
        self._sync_from_rank0()
        self.stage3: Stage3Runtime | None = None
        if self.strategy.shards_params:
            self.stage3 = Stage3Runtime(
                module,
                self.layout,
                self.comm,
                self.lifecycle,
                prefetch_numel=zero.stage3_prefetch_bucket_size,
                max_live_numel=zero.stage3_max_live_parameters,
            )

        self.reducer = GradientReducer(
            self.layout.groups,
            self.comm,
            self.strategy.reduction,
            max_inflight_elements=zero.reduce_bucket_size,
            overlap_comm=zero.overlap_comm,
        )
        if self.stage3 is not None:
            self.reducer.on_group_complete.append(self.stage3.coordinator.on_grads_complete)
        self._managed_params = [p for g in self.layout.groups for p in g.params]
        trainable_params = [p for g in self.layout.groups if g.trainable for p in g.params]
        self._handles += install_parameter_hooks(trainable_params, self.lifecycle, self.reducer)
        self._handles += install_root_hooks(module, self.lifecycle, self._on_forward_start)
        self._handles += [
            self.lifecycle.on_prologue(self._prologue),
            self.lifecycle.on_epilogue(self._epilogue),
            self.lifecycle.on_abort(self._abort),
        ]

        shards = []
        shard_groups: list[dict[str, Any]] = [{"params": [], **spec.options} for spec in specs]
        for grads in self.reducer.groups:
            group = grads.group
            owned = group.full if self.strategy.reduction.optimizer_owns_full_group else group.shard
            shard = shard_parameter(owned)
            shards.append((grads, shard))
            shard_groups[group.param_group_index]["params"].append(shard)
        inner = build_optimizer(optimizer, config.optimizer, shard_groups)
        self.optimizer = ZeroOptimizer(
            inner,
            reducer=self.reducer,
            comm=self.comm,
            shards=shards,
            sharded_grads=self.strategy.shards_optimizer_state,
            resident_groups=self._resident_groups,
            model_params=self._managed_params,
            gradient_clipping=config.gradient_clipping,
            before_step=self._check_can_step,
            on_zero_grad=self.zero_grad,
        )
        self.full_state = FullStateAccessor(
            comm=self.comm,
            reducer=self.reducer,
            groups=self.layout.groups,
            shard_params={id(grads.group): shard for grads, shard in shards},
            optimizer=inner,
            owns_full_group=self.strategy.reduction.optimizer_owns_full_group,
            stage3=self.stage3,
        )
        self.lr_scheduler = self._make_scheduler(lr_scheduler, inner)
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

    def _sync_from_rank0(self) -> None:
        """Every rank starts from rank 0's parameters and buffers, as with DDP."""
        managed = {id(p) for g in self.layout.groups for p in g.params}
        loose = []
        for param in self.module.parameters():
            if id(param) not in managed:
                param.data = param.data.to(self.device)
                loose.append(param.data)
        for buffer_owner in self.module.modules():
            for name, buffer in buffer_owner._buffers.items():
                if buffer is not None:
                    moved = buffer.to(self.device)
                    buffer_owner._buffers[name] = moved
                    loose.append(moved)
        # Groups built sharded by zero.Init were taken from rank 0 already (and are empty now).
        resident = [g for g in self.layout.groups if g.full_is_allocated]
        broadcast_tensors(self.comm, [g.full for g in resident] + loose)
        for group in resident:
            group.take_shard_from_full()

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
        self.reducer.begin_task(is_boundary=self.is_gradient_accumulation_boundary())

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
        """The loss as backward should see it: divided by the accumulation steps."""
        gas = self.gradient_accumulation_steps()
        return loss / gas if gas > 1 else loss

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
        try:
            self.scale(loss).backward(retain_graph=retain_graph, **kwargs)
        except BaseException:
            self._abort_stale_backward()
            raise
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient zerodp keeps (its buffers stay allocated for the next step)."""
        self._abort_stale_backward()
        if autograd_api.in_backward():
            raise LifecycleError("zero_grad() was called inside a backward; call it outside")
        self.reducer.zero()
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
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
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

    def optimizer_extra_state(self) -> list[torch.Tensor]:
        """Optimizer-side tensors outside the torch optimizer's state (fp32 master weights)."""
        return []

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
        self.reducer.groups = []
        self._destroyed = True
