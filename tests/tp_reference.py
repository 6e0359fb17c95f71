"""Tensor-parallel runs of the tiny Llama, and the one-process reference they are compared with.

The reference is the whole model in one process, trained on the same samples: at each
micro-step it runs every data rank's batch, each loss divided by (data ranks x
accumulation), so its gradient is what ideal data parallelism averages; it clips and steps
torch's AdamW (or SGD, whose step is the gradient itself: a uniform scale error that
AdamW's normalisation hides shows in its weights). `train_engine` runs a zerodp engine on
this rank's data index with the same backward pattern. Both record each loss and each
step's global gradient norm, and on request each step's gradients before the step.
`half_reference_run` is zerodp's bf16 / fp16 recipe written out in one process.

Patterns: "plain"; "retain" (a second backward on the retained graph: the gradients add
up); "double" (a gradient penalty: the input embeddings' gradient, taken with
create_graph=True, enters the loss); "checkpoint" (the model's activation checkpointing).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import zerodp
from tests.hf_models import HIDDEN, SEQ_LEN, VOCAB, build_llama

LR = 1e-3
SGD_LR = 0.1  # moves each weight by about 0.1 x its gradient: far above the fp32 bound
MICRO = 2
TENSOR = 2
PATTERNS = ("plain", "retain", "double", "checkpoint")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 2.0**8  # tp_config's initial_scale_power; a few clean steps keep it


def optimizer_block(optimizer: str) -> dict[str, Any]:
    """The config's optimizer block: AdamW at `LR`, or plain SGD at `SGD_LR`."""
    if optimizer == "SGD":
        return {"type": "SGD", "params": {"lr": SGD_LR}}
    return {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}


def torch_optimizer(optimizer: str, params: Any) -> torch.optim.Optimizer:
    """The same optimizer as `optimizer_block`'s, for the one-process reference."""
    if optimizer == "SGD":
        return torch.optim.SGD(params, lr=SGD_LR)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def tp_config(
    stage: int,
    *,
    gas: int = 1,
    clip: float = 0.0,
    dtype: str = "fp32",
    optimizer: str = "AdamW",
    **tensor_parallel: Any,
) -> dict[str, Any]:
    """A config for T=2 at `stage` (every parameter of 10 elements or more sharded at stage 3)."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": optimizer_block(optimizer),
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
    """What a run recorded: (step, micro, data index) -> loss, each step's norm, and (when
    asked) each step's gradients by parameter name before the step."""

    losses: dict[tuple[int, int, int], float] = field(default_factory=dict)
    norms: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


def reference_run(
    steps: int,
    gas: int,
    data_size: int,
    *,
    pattern: str = "plain",
    clip: float = 0.0,
    optimizer: str = "AdamW",
    record_grads: bool = False,
) -> tuple[torch.nn.Module, Trace]:
    """The whole model in one process (see the module docstring)."""
    model = prepared_model(pattern)
    stepper = torch_optimizer(optimizer, model.parameters())
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
        if record_grads:
            trace.grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        stepper.step()
        stepper.zero_grad()
    return model, trace


def half_reference_run(steps: int, data_size: int, dtype: str) -> tuple[torch.nn.Module, Trace]:
    """zerodp's bf16 / fp16 recipe in one process, one micro-step per step: the whole model
    in `dtype` for forward and backward (fp16: the loss times its scale), its gradients
    unscaled into fp32 masters, which AdamW steps and which are copied back into the model.
    Returns the masters (as a model) and the losses."""
    masters = build_llama()
    model = copy.deepcopy(masters).to(HALF[dtype])
    stepper = torch_optimizer("AdamW", masters.parameters())
    scale = FP16_SCALE if dtype == "fp16" else 1.0
    trace = Trace()
    for step in range(steps):
        for data_index in range(data_size):
            loss = micro_loss(model, batch_for(step, 0, data_index), "plain")
            trace.losses[(step, 0, data_index)] = loss.item()
            (loss * scale / data_size).backward()
        for master, param in zip(masters.parameters(), model.parameters(), strict=True):
            master.grad = param.grad.float() / scale
            param.grad = None
        stepper.step()
        stepper.zero_grad()
        with torch.no_grad():
            for master, param in zip(masters.parameters(), model.parameters(), strict=True):
                param.copy_(master)
    return masters, trace


def full_grads(engine: Any) -> dict[str, torch.Tensor]:
    """Each parameter's averaged gradient, this rank's slice of a split one (a collective)."""
    grads = {}
    for name, param in engine.module.named_parameters():
        grad = zerodp.utils.safe_get_full_grad(param)
        if grad is None:
            raise AssertionError(f"{name} has no gradient at the boundary")
        grads[name] = grad.float()
    return grads


def train_engine(
    engine: Any,
    steps: int,
    gas: int,
    data_index: int,
    *,
    pattern: str = "plain",
    record_grads: bool = False,
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
            if record_grads and micro == gas - 1:
                trace.grads.append(full_grads(engine))
            engine.step()
        norm = engine.get_global_grad_norm()
        trace.norms.append(float(norm))
        compared = engine.tensor_parallel.replica_check.check(f"after step {step}")
    return trace, compared


def max_difference(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    if set(actual) != set(expected):
        raise AssertionError(f"names differ: {sorted(set(actual) ^ set(expected))}")
    return max((actual[k].float() - expected[k].float()).abs().max().item() for k in expected)


def slices(
    whole: dict[str, torch.Tensor], split: dict[str, Any], rank: int
) -> dict[str, torch.Tensor]:
    """`whole`'s tensors as tensor rank `rank` holds them: split ones (by `split`, name to
    its `SplitParam`) cut to its slice, the others whole; in fp32."""
    return {
        name: (value.chunk(TENSOR, dim=split[name].dim)[rank] if name in split else value)
        .detach()
        .float()
        for name, value in whole.items()
    }


def relative_update_error(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    start: dict[str, torch.Tensor],
) -> float:
    """|actual - expected| / |expected - start| over all tensors together (2-norms): how
    far off the training's update is, as a fraction of it. An engine that never stepped
    is 1.0 off."""
    off = math.fsum(
        (actual[k].float() - expected[k].float()).square().sum().item() for k in expected
    )
    moved = math.fsum(
        (expected[k].float() - start[k].float()).square().sum().item() for k in expected
    )
    return math.sqrt(off / moved)


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
