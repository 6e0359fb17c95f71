"""The engines the benchmark compares, each behind the same small `Runner` surface.

Every runner trains its own deep copy of one `LossModel` (a GPT whose forward
returns the loss, so DDP's and DeepSpeed's wrappers see the whole step) with
fp32 AdamW at the same learning rate, and knows how to measure its own
model-state bytes and collective traffic for one step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from bench._measure import CollectiveCounter, counting_allreduce_hook, sharded_model_state_bytes
from examples.gpt import GPT
from examples.moe_gpt import MoEGPT
from zerodp.monitor import ModelStateBytes, plain_model_state_bytes

Batch = tuple[torch.Tensor, torch.Tensor]


class LossModel(nn.Module):
    """A GPT whose forward returns the loss: the whole step runs inside each engine's wrapper.

    `leaf_classes`: the model's stage 3 leaf modules (the MoE layers of `examples.moe_gpt`),
    marked by zerodp and DeepSpeed; DDP then looks for unused parameters (idle experts).
    """

    def __init__(self, gpt: GPT | MoEGPT) -> None:
        super().__init__()
        self.gpt = gpt

    @property
    def leaf_classes(self) -> list[type[nn.Module]]:
        return list(getattr(type(self.gpt), "LEAF_CLASSES", ()))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.gpt.loss(tokens, targets)


@dataclass(frozen=True)
class EngineSpec:
    engine: str
    stage: int
    check_order: bool = True  # zerodp stage 3's collective order check (off: "-nocheck")
    stall_checks: bool = True  # zerodp's comms_stall_checks (off: "-nowatch")
    units: str = ""  # zerodp stage 3's stage3_units if not the engine's default ("-modules")

    @property
    def label(self) -> str:
        base = (
            f"{self.engine}-{self.stage}" if self.engine in ("zerodp", "deepspeed") else self.engine
        )
        base = base if self.check_order else f"{base}-nocheck"
        base = f"{base}-{self.units}" if self.units else base
        return base if self.stall_checks else f"{base}-nowatch"


ALL_SPECS: tuple[EngineSpec, ...] = (
    EngineSpec("ddp", 0),
    *(EngineSpec("zerodp", s) for s in range(4)),
    EngineSpec("fsdp2", 3),
    EngineSpec("zero_redundancy", 1),
    *(EngineSpec("deepspeed", s) for s in (1, 2, 3)),
)
# Not in "all": zerodp without its collective order check (stage 3) or without its stall
# checks (uneven inputs, failed peers), to measure what each costs; stage 3 with one group
# per module (`stage3_units: "modules"`, the default before blocks were units).
UNCHECKED_SPEC = EngineSpec("zerodp", 3, check_order=False)
VARIANT_SPECS: tuple[EngineSpec, ...] = (
    UNCHECKED_SPEC,
    EngineSpec("zerodp", 3, units="modules"),
    *(EngineSpec("zerodp", s, stall_checks=False) for s in (1, 2, 3)),
)
ENGINE_CHOICES = (
    "ddp, zerodp, zerodp0..zerodp3, zerodp3nocheck, zerodp3modules, "
    "zerodp1nowatch..zerodp3nowatch, fsdp2, "
    "zero_redundancy, deepspeed, deepspeed1..3"
)


def parse_engines(text: str) -> list[EngineSpec]:
    """`ddp,zerodp3,fsdp2` -> specs in the canonical order; a bare family name means every stage."""
    wanted: set[EngineSpec] = set()
    for raw in text.split(","):
        name = raw.strip().lower().replace("-", "").replace(":", "")
        if not name:
            continue
        matches = [s for s in ALL_SPECS if name in (s.engine, s.label.replace("-", ""))]
        matches += [s for s in VARIANT_SPECS if name == s.label.replace("-", "")]
        if name == "zro":
            matches = [s for s in ALL_SPECS if s.engine == "zero_redundancy"]
        if not matches:
            raise ValueError(f"unknown engine {raw.strip()!r}; choose from {ENGINE_CHOICES}")
        wanted.update(matches)
    return [s for s in (*ALL_SPECS, *VARIANT_SPECS) if s in wanted]


@dataclass(frozen=True)
class TrainSettings:
    """What every engine shares: batch size, optimizer, and the ZeRO knobs."""

    micro_batch: int
    lr: float
    reduce_bucket_size: int
    persistence_threshold: int
    prefetch_bucket_size: int
    dtype: str = "fp32"
    unit_numel: int = 0  # zerodp's stage3_unit_numel (units by size; 0: the engine's default)

    @property
    def bf16(self) -> bool:
        return self.dtype == "bf16"

    def precision_section(self) -> dict[str, Any]:
        return {"bf16": {"enabled": True}} if self.bf16 else {}

    def zero_section(self, stage: int) -> dict[str, Any]:
        return {
            "stage": stage,
            "reduce_bucket_size": self.reduce_bucket_size,
            "overlap_comm": True,
            "stage3_param_persistence_threshold": self.persistence_threshold,
            "stage3_prefetch_bucket_size": self.prefetch_bucket_size,
        }

    def zerodp_config(self, stage: int) -> dict[str, Any]:
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": self.lr, "weight_decay": 0.0}},
            "zero_optimization": self.zero_section(stage)
            | ({"stage3_unit_numel": self.unit_numel} if self.unit_numel else {}),
            **self.precision_section(),
        }

    def deepspeed_config(self, stage: int, world_size: int) -> dict[str, Any]:
        """The same batch sizes; the optimizer is passed in (a torch AdamW: no JIT build)."""
        zero = self.zero_section(stage) | {"allgather_bucket_size": self.reduce_bucket_size}
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": 1,
            "train_batch_size": self.micro_batch * world_size,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            **self.precision_section(),
            "steps_per_print": 1 << 30,
        }

    def adamw(self, params: Any, **extra: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0, **extra)


class Runner:
    """One engine training one model: a step in three parts, and its two measurements."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec

    def forward_backward(self, batch: Batch) -> None:
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def train_step(self, batch: Batch) -> None:
        self.forward_backward(batch)
        self.optimizer_step()
        self.zero_grad()

    def model_state(self, batch: Batch) -> ModelStateBytes | None:
        """Run one step and return this rank's model-state bytes at their fullest, or None."""
        raise NotImplementedError

    def comm(self, batch: Batch) -> tuple[int | None, dict[str, dict[str, int]]]:
        """Run one step; return its collective bytes (None: not visible) and bytes per kind."""
        raise NotImplementedError

    def close(self) -> None:
        """Release hooks and buffers so the next model's engines start clean."""


class ZeroDPRunner(Runner):
    """zerodp at one stage; `engine.step()` zeroes the gradients itself, at the boundary."""

    def __init__(self, spec: EngineSpec, model: nn.Module, settings: TrainSettings) -> None:
        super().__init__(spec)
        config = settings.zerodp_config(spec.stage)
        config["zero_optimization"]["stage3_check_order"] = spec.check_order
        config["comms_stall_checks"] = spec.stall_checks
        if spec.units:
            config["zero_optimization"]["stage3_units"] = spec.units
        if isinstance(model, LossModel) and model.leaf_classes:
            zerodp.zero.set_z3_leaf_modules(model, model.leaf_classes)
        self.engine, _, _, _ = zerodp.initialize(model=model, config=config)

    def forward_backward(self, batch: Batch) -> None:
        self.engine.backward(self.engine(*batch))

    def optimizer_step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        """Nothing to do: `step()` already zeroed (a second zeroing would be timed twice)."""

    def model_state(self, batch: Batch) -> ModelStateBytes | None:
        self.train_step(batch)
        return self.engine.model_state_bytes()

    def comm(self, batch: Batch) -> tuple[int | None, dict[str, dict[str, int]]]:
        stats = self.engine.comm.stats
        stats.reset()
        self.train_step(batch)
        return stats.total_bytes(), stats.snapshot()

    def close(self) -> None:
        self.engine.destroy()


class TorchRunner(Runner):
    """A model trained with torch's own tools (DDP, FSDP2, ZeroRedundancyOptimizer)."""

    def __init__(
        self,
        spec: EngineSpec,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        counter: CollectiveCounter,
        *,
        state_module: nn.Module,
        state_optimizer: torch.optim.Optimizer,
        sharded_params: bool = False,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(spec)
        self.model = model
        self.optimizer = optimizer
        self.counter = counter
        self.state_module = state_module
        self.state_optimizer = state_optimizer
        self.sharded_params = sharded_params
        self.autocast_dtype = autocast_dtype

    def forward_backward(self, batch: Batch) -> None:
        if self.autocast_dtype is None:
            self.model(*batch).backward()
            return
        # torch's own mixed precision for DDP: fp32 parameters, half-precision compute.
        with torch.autocast(batch[0].device.type, dtype=self.autocast_dtype):
            loss = self.model(*batch)
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def model_state(self, batch: Batch) -> ModelStateBytes | None:
        """Measured after the step but before zero_grad, while `.grad` still exists."""
        self.forward_backward(batch)
        self.optimizer_step()
        count = sharded_model_state_bytes if self.sharded_params else plain_model_state_bytes
        state = count(self.state_module, self.state_optimizer)
        self.zero_grad()
        return state

    def comm(self, batch: Batch) -> tuple[int | None, dict[str, dict[str, int]]]:
        with self.counter.active():
            self.train_step(batch)
        return _visible(self.counter.total_bytes()), self.counter.snapshot()


def _visible(nbytes: int) -> int | None:
    """Zero bytes on more than one rank means the traffic went where the wrappers can't see."""
    return None if nbytes == 0 and dist.get_world_size() > 1 else nbytes


def _ddp(model: nn.Module, device: torch.device, counter: CollectiveCounter) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type != "cpu" and device.index is not None else None
    unused = isinstance(model, LossModel) and bool(model.leaf_classes)  # idle experts
    ddp = DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=unused)
    ddp.register_comm_hook(None, counting_allreduce_hook(counter))
    return ddp


def build_ddp(
    spec: EngineSpec, model: nn.Module, settings: TrainSettings, device: torch.device
) -> TorchRunner:
    counter = CollectiveCounter()
    ddp = _ddp(model, device, counter)
    optimizer = settings.adamw(ddp.parameters())
    return TorchRunner(
        spec,
        ddp,
        optimizer,
        counter,
        state_module=model,
        state_optimizer=optimizer,
        autocast_dtype=torch.bfloat16 if settings.bf16 else None,
    )


def build_zero_redundancy(
    spec: EngineSpec, model: nn.Module, settings: TrainSettings, device: torch.device
) -> TorchRunner:
    """DDP for the gradients, ZeroRedundancyOptimizer for sharded AdamW state: torch's stage 1."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    counter = CollectiveCounter()
    ddp = _ddp(model, device, counter)
    optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=settings.lr, weight_decay=0.0
    )
    return TorchRunner(
        spec,
        ddp,
        optimizer,
        counter,
        state_module=model,
        state_optimizer=optimizer.optim,
        autocast_dtype=torch.bfloat16 if settings.bf16 else None,
    )


def build_fsdp2(
    spec: EngineSpec, model: nn.Module, settings: TrainSettings, device: torch.device
) -> TorchRunner:
    """`fully_shard` on each transformer block, then on the root (which holds the embeddings)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if not isinstance(model, LossModel):
        raise TypeError("build_fsdp2 expects a LossModel")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if settings.bf16 else None
    options: dict[str, Any] = {"mesh": mesh} | ({"mp_policy": policy} if policy else {})
    for block in model.gpt.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    optimizer = settings.adamw(model.parameters())
    counter = CollectiveCounter()
    return TorchRunner(
        spec,
        model,
        optimizer,
        counter,
        state_module=model,
        state_optimizer=optimizer,
        sharded_params=True,
    )
