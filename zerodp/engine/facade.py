"""The engine users hold: a facade over the parts `zerodp.engine.assembly` builds.

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

from zerodp.backward import autograd_api
from zerodp.backward.lifecycle import GraphTask
from zerodp.backward.step_gate import GradientState
from zerodp.checkpoint_io import LoadReport
from zerodp.comm import Comm, default_device, ensure_process_group
from zerodp.comm.agreement import agreement
from zerodp.comm.faults.uneven_inputs import Activity, whereabouts
from zerodp.comm.process_group import comms_timeout, local_rank
from zerodp.config import ZeroDPConfig
from zerodp.engine import guards
from zerodp.engine.assembly import Removable, assemble
from zerodp.engine.checkpointing import CheckpointMethods, checkpoint_writer_for
from zerodp.engine.deepspeed_methods import (
    DeepSpeedEngineMethods,
    ZeroGradRoute,
    check_loss,
    model_state_tensors,
)
from zerodp.engine.startup_checks import check_ranks_agree
from zerodp.engine.uneven_join import JoinMethods
from zerodp.errors import LifecycleError, UsageError
from zerodp.full_state import param_managers
from zerodp.group_state import ParamStatus
from zerodp.monitor.events import NON_FINITE_STEPS
from zerodp.monitor.memory import ModelStateBytes, model_state_bytes, with_host_tensors
from zerodp.monitor.training import BoundaryRecord
from zerodp.posttrain.engine_methods import PostTrainingMethods

logger = logging.getLogger("zerodp")


# Keyword arguments of DeepSpeed's `engine.backward` that zerodp accepts beyond torch's own.
_TORCH_BACKWARD_KWARGS = frozenset({"gradient", "create_graph", "inputs"})


class ZeroEngine(DeepSpeedEngineMethods, PostTrainingMethods, CheckpointMethods, JoinMethods):
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
        ensure_process_group(config.comms_timeout_s)
        param_managers.refuse_managed(module)
        comm = Comm(stall_checks=config.comms_stall_checks)
        check_ranks_agree(comm, config, module)  # one small collective, before any other
        agreement().install(comm, comms_timeout(config.comms_timeout_s))
        self.config = config
        self.module = module
        self._destroyed = False
        self.last_load_report: LoadReport | None = None  # what the last load restored
        self.checkpoint_writer = checkpoint_writer_for(config)
        self._init_join()
        parts = assemble(
            module,
            config,
            comm=comm,
            device=default_device(),
            on_forward_start=self._on_forward_start,
            model_parameters=model_parameters,
            user_optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            training_data=training_data,
            collate_fn=collate_fn,
        )
        self.comm = parts.comm
        self.comms = parts.comms  # shard, replica and hpZ groups (docs/multi-node.md)
        # Micro-batches before the boundary agree inside their shard group.
        agreement().install_local(self.comms, comms_timeout(config.comms_timeout_s))
        self.device = parts.device
        self.strategy = parts.strategy
        self.precision = parts.precision
        self.window = parts.window  # the accumulation window (see [Note: gradient factors])
        self.lifecycle = parts.lifecycle
        self.groups = parts.groups
        self.reducer = parts.reducer
        self.params = parts.params
        self.gate = parts.gate
        self._root_hooks = parts.root_hooks
        self.train_state = parts.train_state
        self.optimizer = parts.optimizer
        self.full_state = parts.full_state
        self.lr_scheduler = parts.lr_scheduler
        self.reporter = parts.reporter
        self.eigenvalue = parts.eigenvalue
        self.training_dataloader = parts.training_dataloader
        self.offload = parts.offload
        self._offload_storage = parts.offload_storage
        self.posttrain = parts.posttrain
        self.tensor_parallel = parts.tensor_parallel  # None without tensor parallelism
        self.expert_parallel = parts.experts  # None without expert parallelism
        # sequence_parallel_size > 1: the sequence group and its parts (docs/sequence-parallel.md)
        self.sequence_parallel = parts.sequence
        self._handles: list[Removable] = list(parts.handles)
        self._handles.append(ZeroGradRoute(module, self.zero_grad))
        # Each backward is an activity the ranks agree on ([Note: agreeing before a collective]).
        self._handles.append(
            self.lifecycle.on_prologue(
                lambda task: agreement().begin(
                    Activity.BACKWARD, local=not self.window.task_reduces()
                )
            )
        )
        self._guard = guards.ModuleGuard(module)
        self._handles.append(self._guard)
        state = self.train_state  # its step counts, should this rank get stuck (uneven inputs)
        whereabouts().track(lambda: (state.global_steps, state.micro_steps))
        guards.mark_own_optimizer(self.optimizer)
        guards.mark_own_optimizer(self.optimizer.inner)
        param_managers.register(self, self.groups.params)

    # -- lifecycle callbacks -------------------------------------------------------------

    def _on_forward_start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not autograd_api.in_backward():
            self._guard.check_forward()
            self.ensure_no_stale_backward()
            if self.tensor_parallel is not None:  # the first forward's inputs, compared
                self.tensor_parallel.on_forward_start(args, kwargs)
            self._announce_round(args, kwargs)  # inside engine.join() only
            # See [Note: agreeing before a collective]: inside the shard group but at the
            # accumulation boundary.
            agreement().begin(Activity.FORWARD, local=not self.window.is_boundary())

    def ensure_no_stale_backward(self) -> None:
        """Abort a backward that ended in an exception (its epilogue will never come)."""
        self.gate.ensure_no_stale_backward()

    # -- the training surface ----------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward (stage 3 gathers each module's parameters as it runs)."""
        self.gate.ensure_no_stale_backward("engine(...) (the forward)")
        return self._root_hooks.after_call(self.module(*args, **kwargs))

    forward = __call__

    def scale(
        self, loss: torch.Tensor, retain_graph: bool | None = None, *, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """The loss as backward should start from it: multiplied by the fp16 loss scale
        (the optimizer step divides it out again); the loss itself without fp16.

        Every backward's gradients are divided by the accumulation steps as they arrive,
        however the loss was built (see [Note: gradient factors]); with
        `scale_wrt_gas=False` a backward run from the returned loss is not divided.
        Under fp16 a backward must start from the returned loss itself
        (`engine.scale(a + b).backward()`): one that reaches it from another tensor
        raises, since part of its gradient would miss the scale.
        `retain_graph` is accepted for DeepSpeed's signature; zerodp needs no hint.
        """
        self.gate.ensure_no_stale_backward("engine.scale()")
        self.gate.refuse_if_blocked("engine.scale()")
        check_loss(loss, "engine.scale()")
        return self.window.scale(loss, divided=scale_wrt_gas)

    def backward(
        self,
        loss: torch.Tensor,
        retain_graph: bool = False,
        scale_wrt_gas: bool = True,
        allreduce_gradients: bool = True,
        release_loss: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Run backward on `scale(loss)`; returns `loss`.

        The same as `engine.scale(loss).backward(...)`, or a plain
        `loss.backward()`: every call style divides by the accumulation steps (see
        [Note: gradient factors]). With `scale_wrt_gas=False` the gradients are not
        divided. `create_graph` and `inputs` go to `torch.Tensor.backward`;
        `release_loss` is accepted for DeepSpeed's signature. At an eigenvalue
        boundary the graph is kept for the estimate `step()` makes.
        """
        self.gate.ensure_no_stale_backward("engine.backward()")
        self.gate.refuse_if_blocked("engine.backward()")
        unknown = sorted(set(kwargs) - _TORCH_BACKWARD_KWARGS - {"gradient"})
        if unknown or "gradient" in kwargs:
            raise UsageError(
                f"engine.backward() got unexpected keyword arguments {unknown or ['gradient']}; "
                "it takes retain_graph, scale_wrt_gas, create_graph and inputs (for a "
                "non-scalar tensor, call tensor.backward(gradient) yourself)"
            )
        if not allreduce_gradients:
            raise UsageError(
                "engine.backward(allreduce_gradients=False): zerodp always reduces the "
                "gradients it keeps; to accumulate locally use engine.no_sync() (stages 0-1) "
                "or gradient_accumulation_steps"
            )
        check_loss(loss, "engine.backward()")
        self.reporter.record_loss(loss)
        eigen = self.eigenvalue
        if eigen is not None and eigen.due(
            self.global_steps, self.is_gradient_accumulation_boundary()
        ):
            eigen.keep_loss(loss)
            retain_graph = True
        try:
            self.scale(loss, scale_wrt_gas=scale_wrt_gas).backward(
                retain_graph=retain_graph, **kwargs
            )
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
        state = self.train_state
        if self.is_gradient_accumulation_boundary() and self.window.no_sync_depth > 0:
            self.gate.ensure_no_stale_backward("engine.step()")
            raise LifecycleError(
                "step() at an accumulation boundary inside engine.no_sync(): the "
                "gradients were kept local on purpose; leave the no_sync() block first"
            )
        self.gate.check_can_step()
        if self.is_gradient_accumulation_boundary():
            self.gate.warn_if_nothing_to_apply()
            extra = []
            if self.eigenvalue is not None:
                samples_after = state.global_samples + self.train_batch_size()
                extra = self.eigenvalue.run_pending(state.global_steps, samples_after)
            self.optimizer.apply_step()
            if self.tensor_parallel is not None:  # tensor_parallel.verify_replicated
                self.tensor_parallel.after_step(state.global_steps + 1)
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
        samples, non_finite = self.global_samples, self.gate.non_finite_steps
        if non_finite:  # counted once the first one happens (on_non_finite)
            extra = [*extra, (NON_FINITE_STEPS, float(non_finite), samples)]
        return BoundaryRecord(
            global_samples=samples,
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
        """This process's rank among all ranks of the run (DeepSpeed's `global_rank`)."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """Every rank of the run (data x sequence x tensor ranks); `data_parallel_size` is D."""
        return self.comm.world_size

    @property
    def data_parallel_size(self) -> int:
        """D: the ranks that read different samples (world size / (sequence_parallel_size x
        autotp_size)); DeepSpeed's `dp_world_size`."""
        return self.comms.dims.data_size

    @property
    def data_parallel_rank(self) -> int:
        """Which of the D parts of the data this rank reads (the same in a sequence or tensor
        group); DeepSpeed's `get_data_parallel_rank()`."""
        return self.comms.dims.data_index

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
        """Whether the next `step()` call steps the optimizer.

        Counted from the micro-steps, unless `set_gradient_accumulation_boundary()`
        decided it.
        """
        return self.window.is_boundary()

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

    # -- inspection --------------------------------------------------------------------

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes this rank holds in parameters, gradients and optimizer state.

        Split into device and host: with offload, the optimizer copies and state of
        offloaded groups, their host gradient buffers and offloaded shards count as
        host bytes, and so does what `offload_states()` moved (also on a CPU-only
        machine, where both are the same memory).
        """
        tensors = model_state_tensors(self.module, self.groups, self.optimizer)
        return model_state_bytes(with_host_tensors(tensors, self.posttrain.offload.on_host))

    def param_status(self, param: nn.Parameter) -> ParamStatus:
        """NOT_AVAILABLE, INFLIGHT or AVAILABLE (parameters zerodp does not shard: AVAILABLE)."""
        self.ensure_no_stale_backward()
        return self.params.status(param)

    def destroy(self) -> None:
        """Remove every hook and free zerodp's buffers; the module stays usable."""
        if self._destroyed:
            return
        self.ensure_no_stale_backward()
        self.gate.warn_if_pending_non_finite()  # the last step's norm, not read yet
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.params.teardown()
        for param in self.groups.params:
            param.grad = None
        param_managers.unregister(self.groups.params)
        self.reporter.close()
        if self._offload_storage is not None:
            self._offload_storage.close()  # NVMe files are private to the run: removed
        self.reducer.states = []
        self.gate.close()
        self._destroyed = True
        self.checkpoint_writer.close()  # the end of training waits for its last save
