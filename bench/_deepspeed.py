"""DeepSpeed as an optional peer: used when `import deepspeed` works, never required.

On a CPU-only machine DeepSpeed's comm backend JIT-compiles a shared-memory
all-reduce op ("deepspeed_shm_comm") on first use, which takes about a minute,
and a compile killed half-way leaves a lock file under
~/.cache/torch_extensions that makes later runs wait forever. Training does
not need that op (it serves inference all-reduce), so we mark it incompatible
before DeepSpeed builds its backend.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench._engines import Batch, EngineSpec, Runner, TrainSettings
from bench._measure import CollectiveCounter
from zerodp.monitor import ModelStateBytes

_SHM_OPS = ("deepspeed_shm_comm", "deepspeed_ccl_comm")


def deepspeed_missing_reason() -> str | None:
    """None when DeepSpeed imports; otherwise why not, for the output's notes."""
    if importlib.util.find_spec("deepspeed") is None:
        return "not installed"
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # an installed but broken DeepSpeed is skipped, not fatal
        return f"import failed: {type(exc).__name__}: {exc}"
    return None


def ulysses_slice_loss(
    engine: Any, ids: torch.Tensor, rank: int, size: int
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """DeepSpeed's Ulysses on sequence rank `rank` of `size`, as its data-loader adapter and
    tutorial wire it: the labels shifted on the whole rows, then the rows, positions and
    labels split; (the model's output, this slice's mean loss, its target count). The output
    is returned so that a caller holds its logits through the backward as a loop would."""
    length = ids.shape[1]
    shifted = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    positions = torch.arange(length).expand(ids.shape[0], -1)
    piece = slice(rank * length // size, (rank + 1) * length // size)
    labels = shifted[:, piece].contiguous()
    out = engine(input_ids=ids[:, piece], position_ids=positions[:, piece].contiguous())
    loss = engine.module.loss_function(
        logits=out.logits,
        labels=None,
        shift_labels=labels,
        vocab_size=engine.module.config.vocab_size,
    )
    return out, loss, (labels != -100).sum()


def _skip_shm_op_build() -> None:
    """Make DeepSpeed's backend treat its CPU shared-memory comm op as unavailable (no JIT)."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        for name in _SHM_OPS:
            compatible[name] = False


class DeepSpeedRunner(Runner):
    """deepspeed.initialize at one ZeRO stage with a torch AdamW (no fused-op build on CPU).

    Model-state bytes are not reported: DeepSpeed keeps gradients and fp32
    partitions in its own flat buffers, which the plain parameter/.grad/state
    accounting cannot see, and a partial count would be a wrong number.
    """

    def __init__(
        self, spec: EngineSpec, model: nn.Module, settings: TrainSettings, world_size: int
    ) -> None:
        super().__init__(spec)
        import deepspeed

        _skip_shm_op_build()
        leaf_classes = getattr(model, "leaf_classes", [])
        if leaf_classes:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(model, leaf_classes)
        optimizer = settings.adamw(model.parameters())
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=settings.deepspeed_config(spec.stage, world_size),
        )
        self.counter = CollectiveCounter()

    def forward_backward(self, batch: Batch) -> None:
        self.engine.backward(self.engine(*batch))

    def optimizer_step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        """Nothing to do: DeepSpeed's `step()` zeroes the gradients at the boundary."""

    def model_state(self, batch: Batch) -> ModelStateBytes | None:
        self.train_step(batch)
        return None

    def comm(self, batch: Batch) -> tuple[int | None, dict[str, dict[str, int]]]:
        with self.counter.active(extra_targets=self._comm_backends()):
            self.train_step(batch)
        total = self.counter.total_bytes()
        visible = None if total == 0 and dist.get_world_size() > 1 else total
        return visible, self.counter.snapshot()

    @staticmethod
    def _comm_backends() -> list[Any]:
        """DeepSpeed's backend object, whose methods may hold pre-patch torch references."""
        try:
            from deepspeed.comm import comm as ds_comm
        except ImportError:
            return []
        backend = getattr(ds_comm, "cdb", None)
        return [backend] if backend is not None else []

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if callable(destroy):
            destroy()
