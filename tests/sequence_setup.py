"""Sequence parallelism against one process on the whole sequences (importable by workers).

`run_case` trains the tiny Llama of `tests/hf_models.py` (4 query heads, 2 key/value
heads: grouped-query attention, sdpa) with `"sequence_parallel_size": S` for a few
steps, and beside it, in the same process, a plain copy of the model that computes
every replica's micro-batches on the whole sequences, as one process would: the loss
of each micro-batch, averaged over replicas and micro-batches, backward, clipping,
a torch optimizer step. After every forward the returned `.loss` is compared with
the reference's loss of that micro-batch; after every step the global grad norm
(before clipping) and every full parameter; and the sequence length every decoder
layer saw is recorded. With `monitor`, the csv monitor's train loss of each step is
compared with the reference's losses of that step, averaged: each rank reports the loss of
the whole sequence, so its average over all ranks counts every replica alike.

The data: replica d's micro-batch m of step k is drawn from a generator seeded by
(k, m, d), so replicas read different rows and the ranks of a sequence group the
same ones (the test hands them the batch of `engine.data_parallel_rank`).

AdamW runs with eps 1e-4: its first steps move an element by about lr whatever the
gradient's size, so an element whose gradient is within round-off of zero (the
reference attends over the whole sequence at once, zerodp over head shards: the
additions differ) could step apart by up to lr; eps well above that round-off keeps
the bound at 1e-5 meaningful (a gradient twice too large still moves the weights
by far more). SGD has no such amplification. Muon runs its Newton-Schulz iteration in
fp32 on both sides, for the same reason (`tests.tensorwise_setup.newton_schulz_fp32`).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import math
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import zerodp
from tests.hf_models import VOCAB, build_llama
from tests.tensorwise_setup import newton_schulz
from zerodp import utils

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# bf16 and fp16: the reference is the same recipe (a half-precision model, fp32 master
# weights, SGD) in one process; the gradients round differently (zerodp sums two slices' parts).
MIXED_TOLERANCE = {"bf16": {"rtol": 1.6e-2, "atol": 1e-4}, "fp16": {"rtol": 2e-3, "atol": 1e-5}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 1024.0
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
    lengths: tuple[int, ...] = ()  # per data rank, when they differ (else `length`)
    steps: int = 3
    masked_prompt: bool = False  # the first slice holds no target token
    padding: bool = False  # row 1 starts with padding (attention_mask 0, labels -100)
    packed: bool = False  # position_ids restart inside each row (two documents)
    checkpointing: bool = False  # transformers' gradient checkpointing on both models
    attention: str = "sdpa"  # the model's attention implementation ("eager": its own function)
    dtype: str = "fp32"  # "bf16" and "fp16" need optimizer "sgd" (see MIXED_TOLERANCE)
    monitor: bool = False  # the csv monitor on, its train loss checked (`monitored_losses`)
    zero_init: bool = False  # zerodp's model built under zero.Init (stage 3), the reference not
    zero: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # further top-level config keys

    def config(self) -> dict[str, Any]:
        optimizer = {
            "adamw": {"type": "AdamW", "params": {"lr": LR, "eps": 1e-4, "weight_decay": 0.01}},
            "sgd": {"type": "SGD", "params": {"lr": LR * 10}},
            "muon": None,  # torch's Muon and AdamW, passed to initialize (`optimizers`)
        }[self.optimizer]
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": ROWS,
            "gradient_accumulation_steps": self.gas,
            "sequence_parallel_size": self.sequence,
            "zero_optimization": {
                "stage": self.stage,
                "reduce_bucket_size": 2000,
                "stage3_param_persistence_threshold": 100,
                **self.zero,
            },
            "steps_per_print": 1000,
            **self.extra,
        }
        if optimizer is not None:
            config["optimizer"] = optimizer
        # None: no clipping, written out (DeepSpeed's default, which zerodp follows, is 1.0).
        config["gradient_clipping"] = 0.0 if self.clip is None else self.clip
        if self.dtype == "bf16":
            config["bf16"] = {"enabled": True}
        elif self.dtype == "fp16":
            config["fp16"] = {"enabled": True, "loss_scale": FP16_SCALE}
        return config


def optimizers(case: Case, model: torch.nn.Module, params: Any = None) -> list[Any]:
    """The torch optimizers of `case` on `model`'s parameters (or on `params`, in order)."""
    params = list(model.parameters()) if params is None else list(params)
    if case.optimizer == "adamw":
        return [torch.optim.AdamW(params, lr=LR, eps=1e-4, weight_decay=0.01)]
    if case.optimizer == "sgd":
        return [torch.optim.SGD(params, lr=LR * 10)]
    # Muon steps whole matrices: zerodp exchanges each one's fragments to its owner.
    pairs = list(zip(model.parameters(), params, strict=True))
    hidden = [q for p, q in pairs if p.ndim == 2 and p.shape[0] != VOCAB]
    rest = [q for p, q in pairs if not (p.ndim == 2 and p.shape[0] != VOCAB)]
    return [
        torch.optim.Muon(hidden, lr=2e-3, weight_decay=0.01),
        torch.optim.AdamW(rest, lr=LR, eps=1e-4, weight_decay=0.01),
    ]


def batch(case: Case, step: int, micro: int, replica: int) -> dict[str, torch.Tensor]:
    """The micro-batch `micro` of step `step` of replica `replica` (every rank can draw any)."""
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + replica)
    length = case.lengths[replica] if case.lengths else case.length
    ids = torch.randint(3, VOCAB, (ROWS, length), generator=generator)
    labels = ids.clone()
    out = {"input_ids": ids, "labels": labels}
    if case.masked_prompt:
        # Shifted, position i targets labels[i + 1]: masking labels[0 .. local] leaves the
        # first slice (positions 0 .. local - 1) without a target.
        local = math.ceil(case.length / case.sequence)
        labels[:, : local + 1] = -100
    if case.padding:
        # Left padding: without the mask, every later token would attend to the pads. The
        # last pad's target (the first real token) is masked too: a pad query may attend to
        # nothing, and eager attention then averages every key of the (padded) sequence, a
        # meaningless output that depends on the length (docs/sequence-parallel.md).
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        labels[1, :5] = -100
        ids[1, :4] = 2  # the pad token
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
    """One process on the whole sequences: every replica's micro-batches, averaged.

    In half precision the model is cast and the optimizer steps fp32 master copies, as
    zerodp does (fp16 with a static loss scale).
    """

    def __init__(self, case: Case, model: torch.nn.Module) -> None:
        self.case = case
        self.model = model
        self.masters: list[torch.nn.Parameter] | None = None
        if case.dtype != "fp32":
            self.masters = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
            model.to(DTYPES[case.dtype])
        self.optimizers = optimizers(case, model, self.masters)
        self.scale = FP16_SCALE if case.dtype == "fp16" else 1.0

    def full_param(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """The fp32 value zerodp's master copy of the `index`-th parameter should hold."""
        return param.detach() if self.masters is None else self.masters[index].detach()

    def step(
        self, step: int, replicas: int, first_replicas: int | None = None
    ) -> tuple[list[list[float]], float]:
        """Losses [micro][replica] and the grad norm before clipping of optimizer step `step`.

        `first_replicas`: the data ranks of the window's first micro-batch when they differ
        (a window saved after it and resumed at another D: each micro-batch is averaged
        over the ranks that computed it)."""
        case = self.case
        losses = []
        counts = [replicas] * case.gas
        if first_replicas is not None:
            counts[0] = first_replicas
        for micro, ranks in enumerate(counts):
            row = []
            for replica in range(ranks):
                # use_cache=False, as trainers pass it (and zerodp does when it is not given):
                # with a KV cache transformers does not look for packed sequences.
                inputs = batch(case, step, micro, replica)
                loss = self.model(**inputs, use_cache=False).loss
                (loss * self.scale / (case.gas * ranks)).backward()
                row.append(float(loss.detach()))
            losses.append(row)
        if self.masters is not None:
            for master, param in zip(self.masters, self.model.parameters(), strict=True):
                master.grad = None if param.grad is None else param.grad.float() / self.scale
        stepped = self.masters or list(self.model.parameters())
        params = [p for p in stepped if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, case.clip or math.inf)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad()
        if self.masters is not None:
            with torch.no_grad():
                for master, param in zip(self.masters, self.model.parameters(), strict=True):
                    param.copy_(master)
                    param.grad = None
        return losses, float(norm)


def close(
    actual: float | torch.Tensor,
    expected: float | torch.Tensor,
    what: str,
    tolerance: dict[str, float] = TOLERANCE,
) -> float:
    actual_t = torch.as_tensor(actual).detach().float()
    expected_t = torch.as_tensor(expected).detach().float()
    torch.testing.assert_close(actual_t, expected_t, **tolerance, msg=lambda m: f"{what}: {m}")
    return float((actual_t - expected_t).abs().max())


def check_weights(
    model: torch.nn.Module, reference: Reference, where: str, engine: Any = None
) -> float:
    worst = 0.0
    tolerance = MIXED_TOLERANCE.get(reference.case.dtype, TOLERANCE)
    if engine is not None and engine.tensor_parallel is not None:
        # Tensor-parallel slices: the engine's whole tensors under the model's names.
        whole = engine.state_dict()
        for index, (name, ref_param) in enumerate(reference.model.named_parameters()):
            expected = reference.full_param(index, ref_param)
            worst = max(worst, close(whole[name], expected, f"{where}: {name}", tolerance))
        return worst
    pairs = zip(model.named_parameters(), reference.model.named_parameters(), strict=True)
    for index, ((name, param), (_, ref_param)) in enumerate(pairs):
        full = utils.safe_get_full_fp32_param(param)
        expected = reference.full_param(index, ref_param)
        worst = max(worst, close(full, expected, f"{where}: {name}", tolerance))
    return worst


def train_and_compare(
    case: Case, engine: Any, model: torch.nn.Module, reference: Reference, steps: range
) -> dict[str, float]:
    """Steps `steps` of zerodp beside the reference; the largest differences seen."""
    replicas = engine.data_parallel_size
    mine = engine.data_parallel_rank
    tolerance = MIXED_TOLERANCE.get(case.dtype, TOLERANCE)
    worst = {"loss": 0.0, "norm": 0.0, "weights": 0.0}
    mean_losses = []
    for step in steps:
        expected_losses, expected_norm = reference.step(step, replicas)
        mean_losses.append(sum(map(sum, expected_losses)) / (case.gas * replicas))
        for micro in range(case.gas):
            out = engine(**batch(case, step, micro, mine))
            where = f"{case}, step {step}, micro {micro}"
            if case.extra.get("tiled_compute", {}).get("logits_loss"):
                assert out.logits is None, f"{where}: the tiled loss returned logits"
            expected = expected_losses[micro][mine]
            worst["loss"] = max(
                worst["loss"], close(out.loss, expected, f"{where}: loss", tolerance)
            )
            engine.backward(out.loss)
            engine.step()
        norm = engine.get_global_grad_norm()
        where = f"{case}, step {step}"
        worst["norm"] = max(worst["norm"], close(norm, expected_norm, f"{where}: norm", tolerance))
        worst["weights"] = max(worst["weights"], check_weights(model, reference, where, engine))
    if case.monitor and dist.get_rank() == 0:  # rank 0 writes the monitor's files
        monitored = monitored_losses(engine)
        assert len(monitored) == len(mean_losses), (case, monitored, mean_losses)
        worst["monitor"] = close(monitored, mean_losses, f"{case}: the monitor's train loss")
    return worst


def monitored_losses(engine: Any) -> list[float]:
    """The train loss the csv monitor wrote, one row per optimizer step."""
    monitor = engine.config.csv_monitor
    path = f"{monitor.output_path}/{monitor.job_name}/Train_Samples_train_loss.csv"
    with open(path) as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["step", "value"], rows
    return [float(value) for _, value in rows[1:]]


def _with_monitor(config: dict[str, Any]) -> dict[str, Any]:
    """The csv monitor on, writing under a directory rank 0 made (the ranks' configs agree)."""
    directory = [tempfile.mkdtemp(prefix="zerodp-monitor-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    monitor = {"enabled": True, "output_path": directory[0], "job_name": "job"}
    return {**config, "csv_monitor": monitor}


def run_case(case: Case) -> dict[str, Any]:
    """The comparisons of the module doc for one case; what was seen, for the test to check."""
    if case.zero_init:
        with zerodp.zero.Init(config=case.config()):
            model = build_llama(0)
        plain = build_llama(0)  # the same seed: the same values, whole
    else:
        model = build_llama(0)
        plain = copy.deepcopy(model)
    for built in (model, plain):
        built.set_attn_implementation(case.attention)
        if case.checkpointing:
            built.activation_checkpointing_enable()
    reference = Reference(case, plain)
    given = optimizers(case, model) if case.optimizer == "muon" else None
    config = _with_monitor(case.config()) if case.monitor else case.config()
    engine, _, _, _ = zerodp.initialize(model=model, config=config, optimizer=given)
    lengths = LayerLengths(model)
    fp32_iteration = newton_schulz("fp32") if case.optimizer == "muon" else contextlib.nullcontext()
    try:
        with fp32_iteration:
            worst = train_and_compare(case, engine, model, reference, range(case.steps))
    finally:
        lengths.remove()
        engine.destroy()
    return {
        "rank": dist.get_rank(),
        "layer_lengths": sorted(lengths.seen),
        "sequence_rank": 0 if case.sequence == 1 else engine.sequence_parallel.rank,
        "data_parallel_size": engine.data_parallel_size,
        "dp_world_size": engine.dp_world_size,
        "data_parallel_ranks": (engine.data_parallel_rank, engine.get_data_parallel_rank()),
        **worst,
    }


def run_cases(cases: list[Case]) -> list[dict[str, Any]]:
    return [run_case(case) for case in cases]


def save_after(case: Case, steps: int, directory: str) -> dict[str, float]:
    """Train `steps` steps of `case` beside the reference, then save a checkpoint."""
    model = build_llama(0)
    reference = Reference(case, copy.deepcopy(model))
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    try:
        worst = train_and_compare(case, engine, model, reference, range(steps))
        engine.save_checkpoint(directory, tag="saved")
    finally:
        engine.destroy()
    return worst


def save_inside_window(case: Case, steps: int, directory: str) -> dict[str, float]:
    """Train `steps` steps of `case` beside the reference, then the first micro-batch of the
    next window (its backward only), and save: the checkpoint holds the window's gradients."""
    if case.gas != 2:
        raise ValueError("a window of two micro-batches, saved after the first")
    model = build_llama(0)
    reference = Reference(case, copy.deepcopy(model))
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    try:
        worst = train_and_compare(case, engine, model, reference, range(steps))
        out = engine(**batch(case, steps, 0, engine.data_parallel_rank))
        engine.backward(out.loss)
        engine.step()  # not a boundary: nothing steps
        engine.save_checkpoint(directory, tag="window")
    finally:
        engine.destroy()
    return worst


def resume_inside_window(
    saved: Case, saved_replicas: int, steps: int, case: Case, directory: str
) -> dict[str, Any]:
    """Load the checkpoint `save_inside_window(saved, steps, ...)` wrote, at `case`'s layout and
    stage, run the window's second micro-batch, step, and one more step; the reference
    replays the saved steps, then the window with its first micro-batch averaged over the
    saved data ranks and its second over this run's."""
    model = build_llama(0)
    reference = Reference(case, copy.deepcopy(model))
    replay = Reference(saved, reference.model)
    replay.optimizers = reference.optimizers
    for step in range(steps):
        replay.step(step, saved_replicas)
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    replicas, mine = engine.data_parallel_size, engine.data_parallel_rank
    tolerance = MIXED_TOLERANCE.get(case.dtype, TOLERANCE)
    try:
        path, _ = engine.load_checkpoint(directory, tag="window")
        if path is None:
            raise AssertionError(f"no checkpoint loaded from {directory}")
        losses, norm = reference.step(steps, replicas, first_replicas=saved_replicas)
        out = engine(**batch(case, steps, 1, mine))
        where = f"{saved} -> {case}, the window's second micro-batch"
        worst = {"loss": close(out.loss, losses[1][mine], f"{where}: loss", tolerance)}
        engine.backward(out.loss)
        engine.step()
        worst["norm"] = close(engine.get_global_grad_norm(), norm, f"{where}: norm", tolerance)
        worst["weights"] = check_weights(model, reference, where, engine)
        after = train_and_compare(case, engine, model, reference, range(steps + 1, steps + 2))
        worst = {key: max(value, after[key]) for key, value in worst.items()}
    finally:
        engine.destroy()
    return {"data_parallel_size": replicas, **worst}


def resume(
    saved: Case, saved_replicas: int, steps: int, case: Case, directory: str
) -> dict[str, Any]:
    """Load the checkpoint `save_after(saved, steps, ...)` wrote at another (S, D) and train
    `case` on from step `steps`; the reference replays the saved run's steps first (with the
    replicas it had) and goes on with this run's."""
    model = build_llama(0)
    reference = Reference(case, copy.deepcopy(model))
    replay = Reference(saved, reference.model)
    replay.optimizers = reference.optimizers
    for step in range(steps):
        replay.step(step, saved_replicas)
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    try:
        path, _ = engine.load_checkpoint(directory, tag="saved")
        if path is None:
            raise AssertionError(f"no checkpoint loaded from {directory}")
        check_weights(model, reference, f"{case}: right after loading")
        worst = train_and_compare(case, engine, model, reference, range(steps, steps + 2))
    finally:
        engine.destroy()
    return {"data_parallel_size": engine.data_parallel_size, **worst}


# -- a model zerodp does not switch: its attention wrapped by the user ---------------------------


class TinyCausalLM(torch.nn.Module):
    """One attention block with grouped-query heads, no positions: attention through `attend`."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(3)
        hidden = heads * dim
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.q = torch.nn.Linear(hidden, hidden)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * dim)
        self.out = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, VOCAB)
        self.attend: Any = torch.nn.functional.scaled_dot_product_attention

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        x = self.embed(ids)
        q = self.q(x).view(batch, length, self.heads, self.dim).transpose(1, 2)
        k, v = (
            self.kv(x).view(batch, length, 2 * self.kv_heads, self.dim).transpose(1, 2).chunk(2, 1)
        )
        mixed = self.attend(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(mixed.transpose(1, 2).reshape(batch, length, -1))
        return self.head(torch.tanh(x))


def wrapped_attention_case(stage: int, steps: int = 3) -> dict[str, float]:
    """TinyCausalLM with `zerodp.sequence.sequence_parallel_attention`, the loop splitting its
    own inputs and summing its loss parts, against one process on the whole sequences."""
    from zerodp.sequence import count_targets, sequence_parallel_attention, shift_labels

    case = Case(stage, optimizer="sgd", masked_prompt=True)
    model = TinyCausalLM()
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR * 10)
    model.attend = sequence_parallel_attention(torch.nn.functional.scaled_dot_product_attention)
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    sequence = engine.sequence_parallel
    worst = 0.0
    try:
        for step in range(steps):
            data = batch(case, step, 0, 0)
            shifted = shift_labels(data["labels"])
            targets = count_targets(shifted)
            logits = engine(sequence.split(data["input_ids"]))
            local = sequence.split(shifted, pad_value=-100)
            part = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), local.flatten(), ignore_index=-100, reduction="sum"
            )
            loss = sequence.sum(part / targets)
            engine.backward(loss)
            engine.step()
            ref_logits = reference(data["input_ids"])
            ref_loss = torch.nn.functional.cross_entropy(
                ref_logits.flatten(0, 1), shifted.flatten(), ignore_index=-100
            )
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            worst = max(worst, close(loss, ref_loss, f"wrapped, stage {stage}, step {step}: loss"))
            for (name, param), ref_param in zip(
                model.named_parameters(), reference.parameters(), strict=True
            ):
                full = utils.safe_get_full_fp32_param(param)
                worst = max(worst, close(full, ref_param, f"wrapped, step {step}: {name}"))
    finally:
        engine.destroy()
    return {"worst": worst, "local_length": float(logits.shape[1])}


# -- misuse, the loader, the bytes -------------------------------------------------------------


def _error_of(action: Any) -> str:
    try:
        action()
    except zerodp.UsageError as error:
        return str(error)
    return "no error"


def misuse() -> dict[str, str]:
    """Each misuse's error on this rank (every rank must raise the same), and that the engine
    still trains exactly afterwards."""
    case = Case(2, optimizer="sgd")
    model = build_llama(0)
    reference = Reference(case, copy.deepcopy(model))
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    ids = batch(case, 0, 0, 0)["input_ids"]
    mine = torch.randint(
        3, VOCAB, ids.shape, generator=torch.Generator().manual_seed(dist.get_rank())
    )
    out: dict[str, str] = {
        "join": _error_of(engine.join),
        "different batches": _error_of(lambda: engine(input_ids=mine, labels=mine)),
        "whole with gradients": _error_of(lambda: engine(input_ids=ids)),
        "4D mask": _error_of(
            lambda: engine(
                input_ids=ids, labels=ids, attention_mask=torch.ones(ids.shape[0], 1, 13, 13)
            )
        ),
    }
    with torch.no_grad():  # WHOLE on every rank: the logits of every token, as one process
        whole = engine(input_ids=ids).logits
        expected = reference.model(input_ids=ids).logits
        close(whole, expected, "a forward without labels under no_grad")
        generated = model.generate(ids[:, :5], max_new_tokens=3, do_sample=False)
        expected_ids = reference.model.generate(ids[:, :5], max_new_tokens=3, do_sample=False)
        out["generate"] = "same" if torch.equal(generated, expected_ids) else "differs"
    worst = train_and_compare(case, engine, model, reference, range(2))  # still exact
    out["after"] = f"{worst['weights']:.1e}"
    # A model whose attention no longer goes through transformers' interface.
    model.config._attn_implementation_internal = "sdpa"
    out["bypassed attention"] = _error_of(lambda: engine(input_ids=ids, labels=ids))
    engine.destroy()
    out["restored"] = str(model.config._attn_implementation)
    return out


def refused_at_initialize(heads: int) -> str:
    """A model with `heads` query heads (and as many key/value heads) at S = 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=8 * heads,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )
    model = LlamaForCausalLM(config)
    return _error_of(lambda: zerodp.initialize(model=model, config=Case(1).config()))


def loader_samples(sequence: int) -> list[list[int]]:
    """The first token of every sample each rank's engine loader yields, in order."""
    from tests.hf_models import TokenDataset

    config = {**Case(1, sequence=sequence).config(), "seed": 3}
    engine, _, loader, _ = zerodp.initialize(
        model=build_llama(0), config=config, training_data=TokenDataset(16)
    )
    firsts = [b["input_ids"][:, 0].tolist() for b in loader]
    engine.destroy()
    return firsts


def attention_bytes() -> dict[str, int]:
    """All-to-all bytes of one forward and backward at stage 0, against the closed form."""
    from zerodp.comm import CollectiveKind

    case = Case(0, optimizer="sgd")
    model = build_llama(0)
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    data = batch(case, 0, 0, 0)
    stats = engine.comm.stats
    stats.reset()
    engine.backward(engine(**data).loss)
    measured = stats.bytes[CollectiveKind.ALL_TO_ALL]
    calls = stats.calls[CollectiveKind.ALL_TO_ALL]
    config, size = model.config, case.sequence
    head_dim = config.hidden_size // config.num_attention_heads
    local = -(-case.length // size)
    heads = 2 * config.num_attention_heads + 2 * config.num_key_value_heads  # q, out; k, v
    # Each all-to-all sends (S - 1) / S of the tensor; forward and backward alike.
    per_layer = 4 * ROWS * local * head_dim * heads * (size - 1) // size
    engine.step()
    engine.destroy()
    return {
        "measured": measured,
        "expected": 2 * config.num_hidden_layers * per_layer,
        "calls": calls,
        "expected_calls": 2 * 4 * config.num_hidden_layers,
    }
