"""Tensor-parallel runs of the tiny Llama, and the one-process reference they are compared with.

The reference is the whole model in one process, trained on the same samples: at each
micro-step it runs every data rank's batch, each loss divided by (data ranks x
accumulation), so its gradient is what ideal data parallelism averages; it clips and steps
torch's AdamW. `train_engine` runs a zerodp engine on this rank's data index with the same
backward pattern. Both record each loss and each step's global gradient norm.

Patterns: "plain"; "retain" (a second backward on the retained graph: the gradients add
up); "double" (a gradient penalty: the input embeddings' gradient, taken with
create_graph=True, enters the loss); "checkpoint" (the model's activation checkpointing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.hf_models import HIDDEN, SEQ_LEN, VOCAB, build_llama

LR = 1e-3
MICRO = 2
TENSOR = 2
PATTERNS = ("plain", "retain", "double", "checkpoint")


def tp_config(
    stage: int,
    *,
    gas: int = 1,
    clip: float = 0.0,
    dtype: str = "fp32",
    **tensor_parallel: Any,
) -> dict[str, Any]:
    """A config for T=2 at `stage` (every parameter of 10 elements or more sharded at stage 3)."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 10,
            "reduce_bucket_size": 2000,
        },
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        "tensor_parallel": {"autotp_size": TENSOR, **tensor_parallel},
    }


def batch_for(step: int, micro: int, data_index: int) -> dict[str, torch.Tensor]:
    """The batch data rank `data_index` trains on at (step, micro-step); the same on every
    rank of its tensor group, different across data ranks."""
    generator = torch.Generator().manual_seed(10_000 + 100 * step + 10 * micro + data_index)
    ids = torch.randint(3, VOCAB, (MICRO, SEQ_LEN), generator=generator)
    embeds = torch.randn(MICRO, SEQ_LEN, HIDDEN, generator=generator)
    return {"input_ids": ids, "labels": ids.clone(), "embeds": embeds}


def micro_loss(model: Any, batch: dict[str, torch.Tensor], pattern: str) -> torch.Tensor:
    """The loss of one micro-batch; "double" adds the gradient penalty on the input embeddings."""
    if pattern != "double":
        return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    embeds = batch["embeds"].clone().requires_grad_(True)
    loss = model(inputs_embeds=embeds, labels=batch["labels"]).loss
    (grad,) = torch.autograd.grad(loss, embeds, create_graph=True)
    return loss + 10.0 * grad.square().sum()


def prepared_model(pattern: str) -> torch.nn.Module:
    """The tiny Llama as `pattern` runs it: activation checkpointing on for "checkpoint",
    eager attention for "double" (the fused CPU kernel has no second derivative)."""
    model = build_llama()
    if pattern == "checkpoint":
        model.activation_checkpointing_enable({"use_reentrant": False})
    if pattern == "double":
        model.set_attn_implementation("eager")
    model.train()
    return model


def run_backward(backward: Callable[..., Any], loss: torch.Tensor, pattern: str) -> None:
    if pattern == "retain":
        backward(loss, retain_graph=True)
    backward(loss)


@dataclass
class Trace:
    """What a run recorded: (step, micro, data index) -> loss, and each step's norm."""

    losses: dict[tuple[int, int, int], float] = field(default_factory=dict)
    norms: list[float] = field(default_factory=list)


def reference_run(
    steps: int, gas: int, data_size: int, *, pattern: str = "plain", clip: float = 0.0
) -> tuple[torch.nn.Module, Trace]:
    """The whole model in one process (see the module docstring)."""
    model = prepared_model(pattern)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    trace = Trace()
    for step in range(steps):
        for micro in range(gas):
            for data_index in range(data_size):
                loss = micro_loss(model, batch_for(step, micro, data_index), pattern)
                trace.losses[(step, micro, data_index)] = loss.item()
                scaled = loss / (data_size * gas)
                run_backward(lambda s, **kw: s.backward(**kw), scaled, pattern)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        trace.norms.append(torch.nn.utils.get_total_norm(grads).item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return model, trace


def train_engine(
    engine: Any, steps: int, gas: int, data_index: int, *, pattern: str = "plain"
) -> tuple[Trace, int]:
    """`steps` optimizer steps of `engine` on this rank's batches; after each, the whole
    parameters are checked bitwise equal across the tensor group. Returns the trace and how
    many tensors the checks compared."""
    trace = Trace()
    compared = 0
    for step in range(steps):
        for micro in range(gas):
            loss = micro_loss(engine, batch_for(step, micro, data_index), pattern)
            trace.losses[(step, micro, data_index)] = loss.item()
            run_backward(engine.backward, loss, pattern)
            engine.step()
        norm = engine.get_global_grad_norm()
        trace.norms.append(float(norm))
        compared = engine.tensor_parallel.replica_check.check(f"after step {step}")
    return trace, compared


def max_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    if set(actual) != set(expected):
        raise AssertionError(f"names differ: {sorted(set(actual) ^ set(expected))}")
    return max((actual[k].float() - expected[k].float()).abs().max().item() for k in expected)


def compare(
    engine_trace: Trace,
    weights: dict[str, torch.Tensor],
    reference: torch.nn.Module,
    reference_trace: Trace,
    bound: float,
    where: str,
) -> dict[str, float]:
    """The largest differences of weights, losses and norms; raises beyond `bound`."""
    expected = {k: v.detach() for k, v in reference.state_dict().items()}
    diffs = {
        "weights": max_difference(weights, expected),
        "losses": max(
            abs(value - reference_trace.losses[key]) for key, value in engine_trace.losses.items()
        ),
        "norms": max(
            abs(a - b) for a, b in zip(engine_trace.norms, reference_trace.norms, strict=True)
        ),
    }
    for what, diff in diffs.items():
        if not diff <= bound:
            raise AssertionError(f"{where}: {what} differ by {diff:.3g} > {bound:g} ({diffs})")
    return diffs


# -- a model without a plan of its own, split by the user's ---------------------------------

USER_PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.num_heads = 4  # a head count kept as an attribute: split modules' parents localize it
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class BlockNet(torch.nn.Module):
    """Two MLP blocks with biases (a column-parallel bias is split, a row-parallel one whole)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(2)])
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block_net() -> BlockNet:
    torch.manual_seed(0)
    return BlockNet()


def block_batch(step: int, data_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + 10 * step + data_index)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 3, generator=generator)


def block_loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, target = batch
    return torch.nn.functional.mse_loss(model(x), target)


def block_reference(steps: int, data_size: int) -> torch.nn.Module:
    model = block_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step in range(steps):
        for data_index in range(data_size):
            (block_loss(model, block_batch(step, data_index)) / data_size).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model
