"""Sequence parallelism against one process on the whole sequences (importable by workers).

`run_case` trains the tiny Llama of `tests/hf_models.py` (4 query heads, 2 key/value
heads: grouped-query attention, sdpa) with `"sequence_parallel_size": S` for a few
steps, and beside it, in the same process, a plain copy of the model that computes
every replica's micro-batches on the whole sequences, as one process would: the loss
of each micro-batch, averaged over replicas and micro-batches, backward, clipping,
a torch optimizer step. After every forward the returned `.loss` is compared with
the reference's loss of that micro-batch; after every step the global grad norm
(before clipping) and every full parameter; and the sequence length every decoder
layer saw is recorded.

The data: replica d's micro-batch m of step k is drawn from a generator seeded by
(k, m, d), so replicas read different rows and the ranks of a sequence group the
same ones (the test hands them the batch of `engine.data_parallel_rank`).

AdamW runs with eps 1e-4: its first steps move an element by about lr whatever the
gradient's size, so an element whose gradient is within round-off of zero (the
reference attends over the whole sequence at once, zerodp over head shards: the
additions differ) could step apart by up to lr; eps well above that round-off keeps
the bound at 1e-5 meaningful (a gradient twice too large still moves the weights
by far more). SGD has no such amplification.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import zerodp
from tests.hf_models import VOCAB, build_llama
from zerodp import utils

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
ROWS = 2
LR = 1e-2


@dataclass(frozen=True)
class Case:
    stage: int
    sequence: int = 2
    gas: int = 1
    optimizer: str = "adamw"  # or "sgd"
    clip: float | None = None
    length: int = 13  # not a multiple of 2 or 4
    steps: int = 3
    masked_prompt: bool = False  # the first slice holds no target token
    padding: bool = False  # row 1 ends in padding (attention_mask 0, labels -100)
    packed: bool = False  # position_ids restart inside each row (two documents)
    zero: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # further top-level config keys

    def config(self) -> dict[str, Any]:
        optimizer = (
            {"type": "AdamW", "params": {"lr": LR, "eps": 1e-4, "weight_decay": 0.01}}
            if self.optimizer == "adamw"
            else {"type": "SGD", "params": {"lr": LR * 10}}
        )
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": ROWS,
            "gradient_accumulation_steps": self.gas,
            "sequence_parallel_size": self.sequence,
            "optimizer": optimizer,
            "zero_optimization": {
                "stage": self.stage,
                "reduce_bucket_size": 2000,
                "stage3_param_persistence_threshold": 100,
                **self.zero,
            },
            "steps_per_print": 1000,
            **self.extra,
        }
        if self.clip is not None:
            config["gradient_clipping"] = self.clip
        return config


def reference_optimizer(case: Case, params: Any) -> torch.optim.Optimizer:
    if case.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=LR, eps=1e-4, weight_decay=0.01)
    return torch.optim.SGD(params, lr=LR * 10)


def batch(case: Case, step: int, micro: int, replica: int) -> dict[str, torch.Tensor]:
    """The micro-batch `micro` of step `step` of replica `replica` (every rank can draw any)."""
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + replica)
    ids = torch.randint(3, VOCAB, (ROWS, case.length), generator=generator)
    labels = ids.clone()
    out = {"input_ids": ids, "labels": labels}
    if case.masked_prompt:
        # Shifted, position i targets labels[i + 1]: masking labels[0 .. local] leaves the
        # first slice (positions 0 .. local - 1) without a target.
        local = math.ceil(case.length / case.sequence)
        labels[:, : local + 1] = -100
    if case.padding:
        mask = torch.ones_like(ids)
        mask[1, -4:] = 0
        labels[1, -4:] = -100
        ids[1, -4:] = 2  # the pad token
        out["attention_mask"] = mask
    if case.packed:
        cut = case.length // 2 + 1
        out["position_ids"] = torch.cat(
            [torch.arange(cut), torch.arange(case.length - cut)]
        ).expand(ROWS, -1)
    return out


class LayerLengths:
    """The sequence length each decoder layer's input had, per forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: set[int] = set()
        self.handles = [layer.register_forward_hook(self._record) for layer in model.model.layers]

    def _record(self, module: Any, args: Any, output: Any) -> None:
        self.seen.add(int(args[0].shape[1]))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class Reference:
    """One process on the whole sequences: every replica's micro-batches, averaged."""

    def __init__(self, case: Case, model: torch.nn.Module) -> None:
        self.case = case
        self.model = model
        self.optimizer = reference_optimizer(case, model.parameters())

    def step(self, step: int, replicas: int) -> tuple[list[list[float]], float]:
        """Losses [micro][replica] and the grad norm before clipping of optimizer step `step`."""
        case = self.case
        losses = []
        for micro in range(case.gas):
            row = []
            for replica in range(replicas):
                # use_cache=False, as trainers pass it (and zerodp does when it is not given):
                # with a KV cache transformers does not look for packed sequences.
                inputs = batch(case, step, micro, replica)
                loss = self.model(**inputs, use_cache=False).loss
                (loss / (case.gas * replicas)).backward()
                row.append(float(loss.detach()))
            losses.append(row)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, case.clip or math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return losses, float(norm)


def close(actual: float | torch.Tensor, expected: float | torch.Tensor, what: str) -> float:
    actual_t = torch.as_tensor(actual).detach()
    expected_t = torch.as_tensor(expected).detach()
    torch.testing.assert_close(actual_t, expected_t, **TOLERANCE, msg=lambda m: f"{what}: {m}")
    return float((actual_t - expected_t).abs().max())


def check_weights(model: torch.nn.Module, reference: torch.nn.Module, where: str) -> float:
    worst = 0.0
    pairs = zip(model.named_parameters(), reference.named_parameters(), strict=True)
    for (name, param), (_, ref_param) in pairs:
        full = utils.safe_get_full_fp32_param(param)
        worst = max(worst, close(full, ref_param.detach(), f"{where}: {name}"))
    return worst


def train_and_compare(
    case: Case, engine: Any, model: torch.nn.Module, reference: Reference, steps: range
) -> dict[str, float]:
    """Steps `steps` of zerodp beside the reference; the largest differences seen."""
    replicas = engine.data_parallel_size
    mine = engine.data_parallel_rank
    worst = {"loss": 0.0, "norm": 0.0, "weights": 0.0}
    for step in steps:
        expected_losses, expected_norm = reference.step(step, replicas)
        for micro in range(case.gas):
            out = engine(**batch(case, step, micro, mine))
            where = f"{case}, step {step}, micro {micro}"
            worst["loss"] = max(
                worst["loss"], close(out.loss, expected_losses[micro][mine], f"{where}: loss")
            )
            engine.backward(out.loss)
            engine.step()
        norm = engine.get_global_grad_norm()
        worst["norm"] = max(worst["norm"], close(norm, expected_norm, f"{case}, step {step}: norm"))
        worst["weights"] = max(
            worst["weights"], check_weights(model, reference.model, f"{case}, step {step}")
        )
    return worst


def run_case(case: Case) -> dict[str, Any]:
    """The comparisons of the module doc for one case; what was seen, for the test to check."""
    model = build_llama(0)
    reference = Reference(case, copy.deepcopy(model))
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    lengths = LayerLengths(model)
    try:
        worst = train_and_compare(case, engine, model, reference, range(case.steps))
    finally:
        lengths.remove()
        engine.destroy()
    return {
        "rank": dist.get_rank(),
        "layer_lengths": sorted(lengths.seen),
        "sequence_rank": engine.sequence_parallel.rank,
        **worst,
    }


def run_cases(cases: list[Case]) -> list[dict[str, Any]]:
    return [run_case(case) for case in cases]
