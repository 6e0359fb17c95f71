"""DeepSpeed's engine methods that scripts and tools call, as views of zerodp's parts.

`ZeroEngine` inherits these; each is a thin view (or a documented refusal),
so the engine itself stays a facade of the training surface.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerodp.backward.accumulation import AccumulationWindow
from zerodp.comm import Comm
from zerodp.comm.subgroups import GroupComms
from zerodp.config import ZeroDPConfig
from zerodp.engine.unsupported_attributes import UNSUPPORTED_ENGINE_ATTRIBUTES
from zerodp.errors import NonScalarLossError, UnsupportedFeatureError, UsageError
from zerodp.full_state.state_dicts import full_state_dict, load_state_dict, save_state_dict
from zerodp.group_state import GroupIndex
from zerodp.monitor.memory import ModelStateTensors
from zerodp.monitor.training import TrainingReporter
from zerodp.optim.sharded_optimizer import ZeroOptimizer
from zerodp.optim.strategy import StageStrategy
from zerodp.precision import PrecisionPolicy

logger = logging.getLogger("zerodp")

# Config optimizer types DeepSpeed names in lower case (its own; torch's keep the class name).
_DEEPSPEED_OPTIMIZER_NAMES = frozenset({"adam", "adamw", "adagrad", "lamb", "lion", "muon"})


def check_loss(loss: Any, what: str) -> None:
    """A loss `engine.backward`/`engine.scale` can take: a scalar tensor with a grad_fn."""
    if not isinstance(loss, torch.Tensor):
        raise UsageError(f"{what} expects a tensor loss, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise NonScalarLossError(
            f"{what} needs a scalar tensor as the loss, got shape {tuple(loss.shape)}; reduce "
            "it first (e.g. loss.mean()), or for a non-scalar tensor call "
            "tensor.backward(gradient) yourself (zerodp reduces it just the same)"
        )
    if not loss.requires_grad or loss.grad_fn is None:
        raise UsageError(
            f"{what}: the loss does not require grad (it has no grad_fn): it was computed "
            "without autograd (under torch.no_grad(), or from frozen parameters only)"
        )


class ZeroGradRoute:
    """`model.zero_grad()` clears what the engine keeps, as `engine.zero_grad()` does.

    zerodp keeps gradients in its own buffers, which `nn.Module.zero_grad` cannot
    see; without this, `loss.backward(); optimizer.step(); model.zero_grad()`
    would pile gradients up across steps without a word. `remove()` restores
    the module's own method.
    """

    def __init__(self, module: nn.Module, zero_grad: Callable[[], None]) -> None:
        self.module = module
        original = type(module).zero_grad

        def routed(set_to_none: bool = True) -> None:
            zero_grad()
            original(module, set_to_none)

        module.zero_grad = routed  # type: ignore[method-assign]

    def remove(self) -> None:
        self.module.__dict__.pop("zero_grad", None)


class DeepSpeedEngineMethods:
    """Methods of DeepSpeed's engine beyond the training loop (see each for its semantics)."""

    # Provided by ZeroEngine.
    module: nn.Module
    config: ZeroDPConfig
    comm: Comm
    comms: GroupComms
    strategy: StageStrategy
    precision: PrecisionPolicy
    optimizer: ZeroOptimizer
    reporter: TrainingReporter
    window: AccumulationWindow

    # DeepSpeed's flags for the parallelism zerodp does not have (scripts branch on them).
    has_moe_layers = False
    pipeline_parallelism = False

    if not TYPE_CHECKING:  # a __getattr__ would let the type checker accept any name

        def __getattr__(self, name: str) -> Any:
            """DeepSpeed's engine attributes zerodp lacks raise with what to use instead."""
            if name in UNSUPPORTED_ENGINE_ATTRIBUTES:
                raise UnsupportedFeatureError(
                    f"engine.{name}: {UNSUPPORTED_ENGINE_ATTRIBUTES[name]}"
                )
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- the model ---------------------------------------------------------------------

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's named parameters (at stage 3 read them inside GatheredParameters)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def state_dict(
        self, rank0_only: bool = False, device: str | torch.device = "cpu"
    ) -> dict[str, Any]:
        """The model's full state dict (its keys, unprefixed); a collective at stage 3.

        Gathered group by group; with `rank0_only` only rank 0 keeps (and
        returns) the copy. The same as `zerodp.zero.full_state_dict(engine.module)`.
        """
        return full_state_dict(self.module, rank0_only=rank0_only, device=device)

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> None:
        """Load full tensors into the (possibly sharded) model; every rank passes the same.

        `state_dict` may also be a weights file or a Hugging Face model directory
        (see `zerodp.zero.load_state_dict`); fp32 master weights follow.
        """
        load_state_dict(self.module, state_dict, strict=strict)

    def save_16bit_model(
        self,
        save_dir: str | Path,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write the model's weights in its training dtype to `save_dir/save_filename` (rank 0).

        A collective. At stage 3 the weights are gathered group by group, which
        DeepSpeed (and zerodp) does only with
        `zero_optimization.stage3_gather_16bit_weights_on_model_save: true`;
        without it nothing is saved and False is returned. A name ending in
        `.safetensors` writes safetensors, streamed group by group (rank 0 never
        holds the whole model); anything else is gathered whole on rank 0 and
        written with `torch.save`.
        """
        zero = self.config.zero_optimization
        if self.strategy.shards_params and not zero.stage3_gather_16bit_weights_on_model_save:
            if self.comm.rank == 0:
                logger.warning(
                    "did not save %s: at ZeRO stage 3 the weights are sharded; set "
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save to true to "
                    "gather them for saving, or use save_checkpoint()",
                    Path(save_dir) / save_filename,
                )
            return False
        path = Path(save_dir) / save_filename
        if path.suffix == ".safetensors":  # streamed group by group: never the whole model
            save_state_dict(
                self.module,
                path,
                dtype=self.precision.param_dtype,
                exclude_frozen=exclude_frozen_parameters,
            )
            return True
        state = full_state_dict(self.module, rank0_only=True)
        if self.comm.rank == 0:
            if exclude_frozen_parameters:
                frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
                state = {k: v for k, v in state.items() if k not in frozen}
            dtype = self.precision.param_dtype
            state = {
                k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in state.items()
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
        self.comm.barrier()
        return True

    # -- accumulation ------------------------------------------------------------------

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Decide whether the next step is a boundary yourself (None: count micro-steps again).

        The reduction of the backward that follows and the next `step()` honour it,
        as in DeepSpeed (used by pipeline and custom accumulation loops).
        """
        self.window.boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their gradients local (stages 0 and 1), as DDP's no_sync.

        The reduction happens at the first boundary backward or step after the
        block. `step()` inside the block is an error. Stages 2 and 3 shard
        gradients during every backward, so they have no local gradient to keep:
        there `no_sync()` raises, as in DeepSpeed; use gradient_accumulation_steps.
        """
        if self.strategy.reduction.defer_to_boundary is False:
            raise UsageError(
                f"no_sync() cannot apply at ZeRO stage {self.strategy.stage}: each backward "
                "reduce-scatters its gradients into shards, so there is no local gradient to "
                "keep; accumulate with gradient_accumulation_steps instead (or use stage 0 or 1)"
            )
        self.window.no_sync_depth += 1
        try:
            yield
        finally:
            self.window.no_sync_depth -= 1

    # -- queries -----------------------------------------------------------------------

    @property
    def dp_world_size(self) -> int:
        """The data-parallel world size: the ranks reading different samples (world size /
        (sequence_parallel_size x autotp_size)), as DeepSpeed counts it."""
        return self.comms.dims.data_size

    @property
    def mp_world_size(self) -> int:
        """The model-parallel world size: the tensor-parallel ranks (no pipeline stages)."""
        return self.comms.dims.tensor_size

    def get_data_parallel_rank(self) -> int:
        """Which of the `dp_world_size` parts of the data this rank reads (the same on every
        rank of a sequence or tensor group), as DeepSpeed's data-parallel group rank."""
        return self.comms.dims.data_index

    def get_model_parallel_rank(self) -> int:
        """This rank's place in its tensor group (of `mp_world_size`; no pipeline stages)."""
        return self.comms.dims.tensor_rank

    def get_tensor_parallel_rank(self) -> int:
        return self.comms.dims.tensor_rank

    @property
    def monitor(self) -> Any:
        """The config's monitors (`write_events([(name, value, step), ...])`, `enabled`);
        only rank 0's write, as DeepSpeed's."""
        return self.reporter.monitor

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        sizes = self.config.batch_sizes
        return (
            sizes.train_batch_size,
            sizes.train_micro_batch_size_per_gpu,
            sizes.gradient_accumulation_steps,
        )

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: `betas` (Adam-like), else `momentum` (SGD, RMSprop)."""
        return [
            group["betas"] if "betas" in group else group.get("momentum")
            for group in self.optimizer.param_groups
        ]

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def optimizer_name(self) -> str:
        """The config optimizer's type as DeepSpeed spells it (its own optimizers lower-case,
        torch's by class name), else the class of the optimizer passed in."""
        if self.config.optimizer is not None:
            kind = self.config.optimizer.type
            return kind.lower() if kind.lower() in _DEEPSPEED_OPTIMIZER_NAMES else kind
        return type(self.optimizer.inner).__name__

    def optimizer_params(self) -> dict[str, Any] | None:
        return None if self.config.optimizer is None else dict(self.config.optimizer.params)

    def scheduler_name(self) -> str | None:
        return None if self.config.scheduler is None else self.config.scheduler.type

    def scheduler_params(self) -> dict[str, Any] | None:
        return None if self.config.scheduler is None else dict(self.config.scheduler.params)

    def zero_optimization(self) -> bool:
        return self.strategy.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.strategy.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.strategy.stage >= 3

    def zero_offload_optimizer(self) -> Any:
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Any:
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        offload = self.config.zero_optimization.offload_optimizer
        return offload is not None and offload.device == "cpu"

    def empty_partition_cache(self) -> None:
        """Nothing to release: stage 3 frees each module's gathered parameters after it runs
        (only persistent parameters stay whole, as in DeepSpeed)."""

    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The model's full state dict (a collective at stage 3), as `state_dict()`."""
        if destination is not None or prefix or keep_vars:
            raise UsageError(
                "engine.module_state_dict() takes no destination, prefix or keep_vars in "
                "zerodp; use engine.state_dict() and rename the keys yourself"
            )
        state = full_state_dict(self.module)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def save_fp16_model(
        self, save_dir: str | Path, save_filename: str = "pytorch_model.bin"
    ) -> bool:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the weights (False after an fp16 overflow)."""
        return not self.optimizer.last_step_skipped

    def zero_optimization_stage(self) -> int:
        return self.strategy.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the model's training dtype, the dtype gradients are kept in)."""
        return self.precision.param_dtype, self.precision.grad_storage_dtype


def model_state_tensors(
    module: nn.Module, groups: GroupIndex, optimizer: ZeroOptimizer
) -> ModelStateTensors:
    """The tensors of model state an engine holds, by category and by side (device or host).

    Whole-tensor parameters (`zerodp.optim.tensorwise`) assembled from other ranks'
    fragments have buffers of their own, counted with the optimizer state.
    """
    states = groups.states
    loose = [p for p in module.parameters() if not groups.manages(p)]
    on_host = {id(s.optim.param) for s in states if s.optim is not None and s.optim.offloaded}
    device_state: list[torch.Tensor] = []
    host_state: list[torch.Tensor] = []
    whole = optimizer.torch_optimizers.tensorwise
    if whole is not None:
        by_order = {s.order: s for s in states}
        for task, stepped in whole:
            optim = by_order[task.group].optim
            host = optim is not None and optim.offloaded
            if host:
                on_host.add(id(stepped))
            if not task.is_local(whole.rank):
                (host_state if host else device_state).append(stepped.data)
    for param, slots in optimizer.inner.state.items():
        tensors = [v for v in slots.values() if isinstance(v, torch.Tensor)]
        (host_state if id(param) in on_host else device_state).extend(tensors)
    copies: list[torch.Tensor] = []
    host_copies: list[torch.Tensor] = []
    host_grads: list[torch.Tensor] = []
    for state in states:
        optim = state.optim
        if optim is None or optim.copy is None:
            continue
        if optim.host is None:
            copies.append(optim.copy)
            continue
        host_copies.append(optim.copy)
        host_grads += [
            t
            for t in (optim.host.grad, optim.host.grad_transfer, optim.host.model_staging)
            if t is not None
        ]
    shards = [s.flat.shard for s in states if not s.flat.shard_offloaded]
    host_shards = [s.flat.shard for s in states if s.flat.shard_offloaded]
    secondary = [  # hpZ's copies ([Note: hpZ secondary shard]), kept while stale too
        s.gather.secondary.copy
        for s in states
        if s.gather is not None and s.gather.secondary is not None
    ]
    return ModelStateTensors(
        params=[s.flat.full for s in states] + shards + loose + secondary,
        grads=[s.grads.storage for s in states if s.grads is not None]
        + [p.grad for p in module.parameters() if p.grad is not None],
        optimizer=device_state + copies,
        host_params=host_shards,
        host_grads=host_grads,
        host_optimizer=host_state + host_copies,
    )
