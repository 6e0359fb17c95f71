"""The peers of bench/tensor_parallel.py: FSDP2 with DTensor TP, and DeepSpeed's AutoTP.

Each function trains the tiny Llama it is handed with the loop `bench.tensor_parallel.train`
runs, and returns what that loop records plus the whole weights (FSDP2) or this rank's slices
compared with the one-process weights (DeepSpeed, whose slices are its own layer classes').
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Llama's linear layers inside a decoder layer, by the DTensor style that splits them.
COLUMN = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
ROW = ("self_attn.o_proj", "mlp.down_proj")


def fsdp2_tensor_parallel(model: nn.Module, data: int, tensor: int, device: torch.device) -> Any:
    """2-D parallelism as torchtitan composes it (without its sequence-parallel norms and
    loss-parallel head): `parallelize_module` on each decoder layer over the "tp" mesh
    dimension (q/k/v, gate, up column-wise; o, down row-wise; the tied embeddings and the norms
    whole), then `fully_shard` on each layer and on the root over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(device.type, (data, tensor), mesh_dim_names=("dp", "tp"))
    plan: dict[str, Any] = {name: ColwiseParallel() for name in COLUMN}
    plan |= {name: RowwiseParallel() for name in ROW}
    layers = model.model.layers  # type: ignore[union-attr]
    for layer in layers:
        parallelize_module(layer, mesh["tp"], plan)
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def fsdp2_grad_norm(model: nn.Module) -> float:
    """The global norm: each gradient's own norm over its whole tensor (a DTensor's norm
    reduces over its mesh), squared and added: the parameters live on two meshes, which
    torch's `get_total_norm` does not mix."""
    total = 0.0
    for param in model.parameters():
        if param.grad is not None:
            total += float(whole(param.grad.norm())) ** 2
    return total**0.5


def fsdp2_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's bytes of parameters, gradients and AdamW state (local shards)."""
    tensors = [local(p) for p in model.parameters()]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [local(v) for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def deepspeed_config(stage: int, micro: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1e6,  # never clips; makes every stage compute the norm it reports
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10},
        "tensor_parallel": {"autotp_size": None},  # set by the caller
        "zero_allow_untested_optimizer": True,  # torch's AdamW (no fused-op build on CPU)
        "steps_per_print": 1_000_000,
    }


def slice_difference(
    engine: Any, stage: int, reference: dict[str, torch.Tensor], tensor: int
) -> tuple[float, list[str]]:
    """The largest difference of this rank's slices from the same slices of the one-process
    weights: a parameter of the whole shape is compared whole, one smaller along a dimension
    by T with its tensor rank's chunk there (at stage 3 gathered over the data ranks first).
    Returns it and the names the reference has that the engine does not."""
    import deepspeed
    from deepspeed.utils import groups

    tensor_rank = groups.get_tensor_model_parallel_rank()
    named = dict(engine.module.named_parameters())
    params = list(named.values())
    gather = deepspeed.zero.GatheredParameters(params) if stage == 3 else nullcontext()
    worst = 0.0
    with gather:
        for name, param in named.items():
            expected = reference[name]
            value = param.detach().float()
            if value.shape != expected.shape:
                dims = [
                    d for d in range(expected.dim()) if value.shape[d] * tensor == expected.shape[d]
                ]
                if len(dims) != 1:
                    raise AssertionError(f"{name}: {tuple(value.shape)} vs {tuple(expected.shape)}")
                expected = expected.chunk(tensor, dim=dims[0])[tensor_rank]
            worst = max(worst, (value - expected).abs().max().item())
    return worst, sorted(set(reference) - set(named))


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())
