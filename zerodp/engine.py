"""The engine users hold: a facade over the parts `zerodp.assembly` builds.

It owns no collective, layout or stage logic: the stage strategy decides,
`partition` lays out, `backward` reduces, `params` gathers (stage 3, or a null
object at stages 0-2), `optim` steps, the step gate says whether a step may
run. The engine keeps DeepSpeed's surface (`backward`, `step`, `zero_grad`,
counters) and hands narrow views of itself to checkpoints and monitors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from zerodp.assembly import EngineCallbacks, assemble
from zerodp.backward import autograd_api
from zerodp.backward.lifecycle import GraphTask
from zerodp.backward.step_gate import GradientState
from zerodp.checkpoint import CheckpointSubject, load_checkpoint, save_checkpoint
from zerodp.checkpoint.stateful import OptimizerSettings, SchedulerState
from zerodp.comm import Comm, default_device, ensure_process_group
from zerodp.comm.group import local_rank
from zerodp.config import ZeroDPConfig
from zerodp.errors import LifecycleError
from zerodp.group import ParamStatus
from zerodp.monitor.memory import (
    ModelStateBytes,
    ModelStateTensors,
    model_state_bytes,
    optimizer_state_tensors,
)
from zerodp.monitor.training import BoundaryRecord

logger = logging.getLogger("zerodp")

# Every managed parameter -> the live engine managing it (for `zerodp.utils`, `zerodp.zero`).
_ENGINES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def engine_of(param: torch.Tensor) -> ZeroEngine | None:
    """The live engine that manages `param`, or None."""
    engine = _ENGINES.get(param)
    return engine if isinstance(engine, ZeroEngine) else None


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
        _refuse_managed(module)
        self.config = config
        self.module = module
        self._destroyed = False
        parts = assemble(
            module,
            config,
            comm=Comm(),
            device=default_device(),
            callbacks=EngineCallbacks(
                on_forward_start=self._on_forward_start,
                is_boundary=self.is_gradient_accumulation_boundary,
                prologue_scale=self._unscaled_backward_factor,
            ),
            model_parameters=model_parameters,
            user_optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            training_data=training_data,
            collate_fn=collate_fn,
        )
        self.comm = parts.comm
        self.device = parts.device
        self.strategy = parts.strategy
        self.precision = parts.precision
        self.lifecycle = parts.lifecycle
        self.groups = parts.groups
        self.reducer = parts.reducer
        self.params = parts.params
        self.gate = parts.gate
        self.train_state = parts.train_state
        self.optimizer = parts.optimizer
        self.full_state = parts.full_state
        self.lr_scheduler = parts.lr_scheduler
        self.reporter = parts.reporter
        self.eigenvalue = parts.eigenvalue
        self.training_dataloader = parts.training_dataloader
        self._handles: list[RemovableHandle] = parts.handles
        for param in self.groups.params:
            _ENGINES[param] = self

    # -- lifecycle callbacks -------------------------------------------------------------

    def _on_forward_start(self) -> None:
        if not autograd_api.in_backward():
            self.ensure_no_stale_backward()

    def _unscaled_backward_factor(self) -> float:
        """What a backward's gradients are multiplied by when its loss was not `scale()`d.

        The fp16 loss scale, so that every kept gradient carries the same scale
        (a task whose loss came from `scale()` is marked by a hook on that loss,
        see `scale`, and gets 1).
        """
        return self.optimizer.loss_scaler.scale

    def ensure_no_stale_backward(self) -> None:
        """Abort a backward that ended in an exception (its epilogue will never come)."""
        self.gate.ensure_no_stale_backward()

    # -- the training surface ----------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward (stage 3 gathers each module's parameters as it runs)."""
        return self.module(*args, **kwargs)

    forward = __call__

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as backward should see it: divided by the accumulation steps, and
        multiplied by the fp16 loss scale (the optimizer step divides it out again).

        The returned tensor carries a hook that tells the backward running through it
        that its loss is scaled already, however often (or never) it is run.
        """
        gas = self.gradient_accumulation_steps()
        factor = self.optimizer.loss_scaler.scale / gas
        if factor == 1.0:
            return loss
        scaled = loss * factor
        if scaled.requires_grad:
            scaled.register_hook(self.lifecycle.hook(self._mark_task_scaled))
        return scaled

    def _mark_task_scaled(self, grad: torch.Tensor) -> None:
        self.reducer.mark_task_scaled()

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, **kwargs: Any
    ) -> torch.Tensor:
        """Run backward on `scale(loss)`; returns `loss`.

        The same as `engine.scale(loss).backward(...)`; keyword arguments go to
        `torch.Tensor.backward`. At an eigenvalue boundary the graph is kept for
        the estimate `step()` makes.
        """
        self.ensure_no_stale_backward()
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
            eigen.keep_loss(loss)
            retain_graph = True
        try:
            self.scale(loss).backward(retain_graph=retain_graph, **kwargs)
        except BaseException:
            self.ensure_no_stale_backward()
            raise
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient zerodp keeps (its buffers stay allocated for the next step)."""
        self.gate.zero_grad()
        if self.eigenvalue is not None:
            self.eigenvalue.drop_pending()

    def step(self) -> None:
        """At an accumulation boundary: optimizer and scheduler step, then zero_grad().

        Between boundaries it only counts the micro-step. Zeroing after the
        boundary step follows DeepSpeed; within an accumulation window,
        gradients add up across every backward until then, as in PyTorch.
        """
        self.gate.check_can_step()
        state = self.train_state
        if self.is_gradient_accumulation_boundary():
            self.gate.warn_if_nothing_to_apply()
            extra = []
            if self.eigenvalue is not None:
                samples_after = state.global_samples + self.train_batch_size()
                extra = self.eigenvalue.run_pending(state.global_steps, samples_after)
            self.optimizer.apply_step()
            if self.lr_scheduler is not None and not self.optimizer.last_step_skipped:
                self.lr_scheduler.step()
            state.global_steps += 1
            state.global_samples += self.train_batch_size()
            self.reporter.on_boundary(lambda: self._boundary_record(extra))
            self.zero_grad()
            if state.global_steps % self.config.steps_per_print == 0 and self.global_rank == 0:
                logger.info("step %d: lr %s", state.global_steps, self.get_lr())
        state.micro_steps += 1

    def _boundary_record(self, extra: list[tuple[str, float, int]]) -> BoundaryRecord:
        return BoundaryRecord(
            global_samples=self.global_samples,
            lr=self.get_lr()[0],
            loss_scale=self.loss_scale,
            grad_norm=self.get_global_grad_norm(),
            train_batch_size=self.train_batch_size(),
            extra=extra,
        )

    # -- accessors DeepSpeed users reach for ------------------------------------------------

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (accumulation boundaries passed)."""
        return self.train_state.global_steps

    @property
    def micro_steps(self) -> int:
        """`step()` calls so far, one per micro-batch."""
        return self.train_state.micro_steps

    @property
    def global_samples(self) -> int:
        """Samples consumed by all ranks together."""
        return self.train_state.global_samples

    @property
    def gradient_state(self) -> GradientState:
        """CLEAN, ACCUMULATED or INCOMPLETE: what `step()` would apply now."""
        return self.gate.state

    @property
    def global_rank(self) -> int:
        """This process's rank in the data-parallel group."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """The number of data-parallel ranks."""
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's LOCAL_RANK)."""
        return local_rank()

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage, 0 to 3."""
        return self.strategy.stage

    @property
    def block_eigenvalue(self) -> dict[int, float]:
        """The latest top Hessian eigenvalue per block (eigenvalue monitoring)."""
        return {} if self.eigenvalue is None else dict(self.eigenvalue.latest)

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.batch_sizes.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on each rank."""
        return self.config.batch_sizes.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        """Samples per optimizer step, over all ranks (micro batch x accumulation x ranks)."""
        return self.config.batch_sizes.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` call steps the optimizer."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.optimizer.loss_scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because gradients overflowed (fp16)."""
        return self.train_state.skipped_steps

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer param group."""
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
        """Put the model in training mode (as `nn.Module.train`)."""
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        """Put the model in evaluation mode (as `nn.Module.eval`)."""
        self.module.eval()
        return self

    # -- checkpoints -----------------------------------------------------------------

    def save_checkpoint(
        self, save_dir: Any, tag: str | None = None, client_state: Any = None
    ) -> str:
        """Save everything needed to resume, sharded, with torch.distributed.checkpoint.

        A collective: every rank calls it. Written under a temporary name and made
        visible (renamed, then `latest` updated) only once every rank has finished.
        Returns the checkpoint's path. See zerodp.checkpoint for the format.
        """
        return str(save_checkpoint(self._checkpoint_subject(), save_dir, tag, client_state))

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, Any]:
        """Load a checkpoint saved at any stage and world size; returns (path, client_state).

        Everything is checked (on every rank, agreed) before anything is changed.
        With no tag and no `latest` file in `load_dir` (nothing saved yet), nothing is
        loaded and (None, None) is returned, as in DeepSpeed.
        """
        return load_checkpoint(
            self._checkpoint_subject(),
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )

    def _checkpoint_subject(self) -> CheckpointSubject:
        def after_load() -> None:
            self.optimizer.sync_params_from_owned()
            self.zero_grad()

        return CheckpointSubject(
            comm=self.comm,
            module=self.module,
            groups=self.groups,
            optimizer=self.optimizer.inner,
            zero_stage=self.zero_stage,
            param_dtype=self.precision.param_dtype,
            counters=self.train_state,
            optimizer_settings=OptimizerSettings(self.optimizer.inner),
            loss_scaler=self.optimizer.loss_scaler,
            lr_scheduler=None if self.lr_scheduler is None else SchedulerState(self.lr_scheduler),
            dataloader=self.training_dataloader,
            check_idle=lambda: self.gate.check_outside_backward("a checkpoint save or load"),
            after_load=after_load,
        )

    # -- inspection --------------------------------------------------------------------

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes this rank holds in parameters, gradients and optimizer state."""
        states = self.groups.states
        loose = [p for p in self.module.parameters() if not self.groups.manages(p)]
        kept = [s.grads.storage for s in states if s.grads is not None]
        user_grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        copies = [s.optim.copy for s in states if s.optim is not None and s.optim.copy is not None]
        return model_state_bytes(
            ModelStateTensors(
                params=[s.flat.full for s in states] + [s.flat.shard for s in states] + loose,
                grads=kept + user_grads,
                optimizer=optimizer_state_tensors(self.optimizer) + copies,
            )
        )

    def param_status(self, param: nn.Parameter) -> ParamStatus:
        """NOT_AVAILABLE, INFLIGHT or AVAILABLE (parameters zerodp does not shard: AVAILABLE)."""
        self.ensure_no_stale_backward()
        return self.params.status(param)

    def destroy(self) -> None:
        """Remove every hook and free zerodp's buffers; the module stays usable."""
        if self._destroyed:
            return
        self.ensure_no_stale_backward()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.params.teardown()
        for param in self.groups.params:
            param.grad = None
            _ENGINES.pop(param, None)
        self.reporter.close()
        self.reducer.states = []
        self._destroyed = True


def _refuse_managed(module: nn.Module) -> None:
    """A model one live engine manages cannot be handed to a second one (checked first)."""
    for name, param in module.named_parameters():
        if engine_of(param) is not None:
            raise LifecycleError(
                f"parameter '{name}' is already managed by a zerodp engine; call "
                "engine.destroy() on that engine first, or keep training with it"
            )
