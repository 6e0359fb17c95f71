"""Expert parallelism in the engine against one process on the same data (importable by workers).

`run_case` trains a tiny Hugging Face MoE model (`tests/hf_moe_models.py`: 8 experts, top-2)
with `"expert_parallel": {"enabled": true, "autoep_size": E}` for a few steps, and beside it,
in the same process, a plain copy of the model that computes every data rank's micro-batches
on the whole sequences, as one process would: each micro-batch's loss, averaged over the data
ranks and micro-batches, backward, clipping, a torch optimizer step. After every forward the
returned `.loss` (with the auxiliary load-balancing loss when `aux`) is compared with the
reference's loss of that micro-batch; after every step the global grad norm (before clipping)
and every parameter: whole parameters whole, expert slices against the same experts of the
reference's whole tensors. While the model runs, each experts module is seen holding N / E
experts (its fused tensors' first dimension, gathered at stage 3).

The data: data rank d's micro-batch m of step k is `token_batch(10 * m + d, k)`, so data ranks
read different tokens and the ranks of a sequence group the same ones (the test hands them
the batch of `engine.data_parallel_rank`).

AdamW runs with eps 1e-4 and SGD has no amplification, for the reason given in
tests/sequence_setup.py: an element whose gradient is within round-off of zero would
otherwise step apart by up to lr under Adam's normalisation.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import zerodp
from tests.hf_moe_models import NUM_EXPERTS, build, experts_of, route_only_to, token_batch
from zerodp import utils
from zerodp.partition.slicing import Slicing

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# bf16: the reference is the same recipe in one process (a bf16 model, fp32 master weights,
# SGD); the additions round differently (each rank sums its own tokens' parts), as in
# tests/sequence_setup.py.
BF16_TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-4}
LR = 1e-2


@dataclass(frozen=True)
class Case:
    stage: int
    model: str = "qwen3_moe"
    expert: int = 2
    sequence: int = 1
    gas: int = 1
    optimizer: str = "sgd"  # or "adamw"
    clip: float = 0.0
    aux: bool = False  # output_router_logits: the auxiliary loss is part of the loss
    idle_pairs: int = 0  # > 0: only experts 0 .. 2 * pairs - 1 get tokens at first
    steps: int = 3
    bf16: bool = False  # a bf16 model with fp32 master weights (with SGD)
    checkpointing: bool = False  # transformers' activation checkpointing on both models
    retained: bool = False  # each micro-batch's backward runs twice on a retained graph
    # Keys naming the experts modules in the config instead of the model's own plan.
    experts_named: tuple[tuple[str, Any], ...] = ()
    shard: int | None = None  # mics_shard_size: shard groups that replicate each other (E = 1)

    def config(self) -> dict[str, Any]:
        optimizer = {
            "sgd": {"type": "SGD", "params": {"lr": LR * 10}},
            "adamw": {
                "type": "AdamW",
                "params": {"lr": LR, "eps": 1e-4, "weight_decay": 0.01},
            },
        }[self.optimizer]
        return {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": self.gas,
            "optimizer": optimizer,
            "gradient_clipping": self.clip,
            "sequence_parallel_size": self.sequence,
            "zero_optimization": {
                "stage": self.stage,
                "reduce_bucket_size": 2000,
                "stage3_param_persistence_threshold": 50,
                **({} if self.shard is None else {"mics_shard_size": self.shard}),
            },
            "expert_parallel": {
                "enabled": self.expert > 1,
                "autoep_size": self.expert,
                **dict(self.experts_named),
            },
            "bf16": {"enabled": self.bf16},
            "steps_per_print": 1000,
        }


def build_pair(case: Case) -> tuple[torch.nn.Module, torch.nn.Module]:
    """zerodp's model and the reference: the same values, from one seed."""
    model = build(case.model, seed=0)
    if case.idle_pairs:
        route_only_to(model, case.idle_pairs)
    if case.aux:
        model.config.output_router_logits = True
        model.config.router_aux_loss_coef = 0.1  # large enough to move the router
    if case.checkpointing:
        model.activation_checkpointing_enable()
    return model, copy.deepcopy(model)


def reference_optimizer(case: Case, model: torch.nn.Module) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR * 10)
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4, weight_decay=0.01)


def micro_batch(step: int, micro: int, data_rank: int) -> torch.Tensor:
    return token_batch(10 * micro + data_rank, step)


class Reference:
    """One process: every data rank's micro-batches on the whole sequences, averaged."""

    def __init__(self, case: Case, model: torch.nn.Module) -> None:
        self.case, self.model = case, model
        self.masters: list[torch.nn.Parameter] | None = None
        if case.bf16:  # zerodp's recipe: a bf16 model, fp32 masters stepped by the optimizer
            self.masters = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
            model.to(torch.bfloat16)
        self.optimizer = reference_optimizer(case, model)
        if self.masters is not None:
            self.optimizer = reference_optimizer(case, torch.nn.ParameterList(self.masters))

    def step(self, step: int, data_ranks: int, first_micro: int = 0) -> tuple[list, float]:
        """Losses [micro][data rank] and the grad norm before clipping of step `step`."""
        case = self.case
        losses = []
        for micro in range(first_micro, case.gas):
            row = []
            for d in range(data_ranks):
                ids = micro_batch(step, micro, d)
                loss = self.model(input_ids=ids, labels=ids).loss
                passes = 2 if case.retained else 1  # the same gradient twice: 2x
                for _ in range(passes):
                    (loss / (case.gas * data_ranks)).backward(retain_graph=case.retained)
                row.append(float(loss.detach()))
            losses.append(row)
        stepped = list(self.model.parameters())
        if self.masters is not None:
            for master, param in zip(self.masters, stepped, strict=True):
                master.grad = None if param.grad is None else param.grad.float()
            stepped = self.masters
        params = [p for p in stepped if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, case.clip or math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.masters is not None:
            with torch.no_grad():
                for master, param in zip(self.masters, self.model.parameters(), strict=True):
                    param.copy_(master)
                    param.grad = None
        return losses, float(norm)

    def full_param(self, name: str) -> torch.Tensor:
        """The fp32 value zerodp's optimizer copy of parameter `name` should hold."""
        names = [n for n, _ in self.model.named_parameters()]
        if self.masters is None:
            return dict(self.model.named_parameters())[name].detach()
        return self.masters[names.index(name)].detach()


def close(actual: Any, expected: Any, what: str, tolerance: dict[str, float] = TOLERANCE) -> float:
    a = torch.as_tensor(actual).detach().float()
    e = torch.as_tensor(expected).detach().float()
    torch.testing.assert_close(a, e, **tolerance, msg=lambda m: f"{what}: {m}")
    return float((a - e).abs().max())


def check_weights(engine: Any, model: torch.nn.Module, reference: Reference, where: str) -> float:
    """Every parameter: a whole one whole, an expert slice against the same experts."""
    split = engine.expert_parallel
    tolerance = BF16_TOLERANCE if reference.case.bf16 else TOLERANCE
    worst = 0.0
    for name, param in model.named_parameters():
        value = utils.safe_get_full_fp32_param(param)
        whole = reference.full_param(name)
        if split is not None and split.expert_of(name) is not None:
            whole = split.local_part_named(name, whole)
        worst = max(worst, close(value, whole, f"{where}: {name}", tolerance))
    return worst


class ExpertCounts:
    """The number of experts each experts module holds while its forward runs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: set[int] = set()
        self._handles = [m.register_forward_pre_hook(self._record) for m in experts_of(model)]

    def _record(self, module: torch.nn.Module, args: Any) -> None:
        self.seen.add(int(next(module.parameters()).shape[0]))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def train_and_compare(
    case: Case, engine: Any, model: torch.nn.Module, reference: Reference, steps: range
) -> dict[str, float]:
    data_ranks, mine = engine.data_parallel_size, engine.data_parallel_rank
    tolerance = BF16_TOLERANCE if case.bf16 else TOLERANCE
    worst = {"loss": 0.0, "norm": 0.0, "weights": 0.0}
    for step in steps:
        expected_losses, expected_norm = reference.step(step, data_ranks)
        for micro in range(case.gas):
            ids = micro_batch(step, micro, mine)
            out = engine(input_ids=ids, labels=ids)
            where = f"{case}, step {step}, micro {micro}"
            expected = expected_losses[micro][mine]
            worst["loss"] = max(
                worst["loss"], close(out.loss, expected, f"{where}: loss", tolerance)
            )
            if case.retained:  # a retained graph run backward again: its gradient twice
                out.loss.backward(retain_graph=True)
                out.loss.backward()
            else:
                engine.backward(out.loss)
            engine.step()
        where = f"{case}, step {step}"
        norm = engine.get_global_grad_norm()
        worst["norm"] = max(worst["norm"], close(norm, expected_norm, f"{where}: norm", tolerance))
        worst["weights"] = max(worst["weights"], check_weights(engine, model, reference, where))
    return worst


def run_case(case: Case) -> dict[str, Any]:
    model, plain = build_pair(case)
    reference = Reference(case, plain)
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    counts = ExpertCounts(model)
    experts = [s for s in engine.groups if s.flat.slicing is Slicing.EXPERT]
    try:
        worst = train_and_compare(case, engine, model, reference, range(case.steps))
    finally:
        counts.remove()
        engine.destroy()
    return {
        "rank": dist.get_rank(),
        "experts_held": sorted(counts.seen),
        "expected_held": NUM_EXPERTS // case.expert,
        # Stage 3 gathers experts only where an expert-data group has more than one rank.
        "expert_groups_gathered": sorted({s.gather is not None for s in experts}),
        "expert_data_size": engine.comms.dims.expert_data_size,
        "data_parallel_size": engine.data_parallel_size,
        **worst,
    }


def run_cases(cases: list[Case]) -> list[dict[str, Any]]:
    return [run_case(case) for case in cases]


def save_after(case: Case, steps: int, directory: str) -> dict[str, float]:
    """Train `steps` steps of `case` beside the reference, then save a checkpoint."""
    model, plain = build_pair(case)
    reference = Reference(case, plain)
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    try:
        worst = train_and_compare(case, engine, model, reference, range(steps))
        engine.save_checkpoint(directory, tag="saved")
    finally:
        engine.destroy()
    return worst


def resume(
    saved: Case, saved_data_ranks: int, steps: int, case: Case, directory: str
) -> dict[str, Any]:
    """Load the checkpoint `save_after(saved, steps, ...)` wrote, in `case`'s layout (another
    E, stage or number of data ranks), and train on; the reference replays the saved run's
    steps with its data ranks first."""
    model, plain = build_pair(case)
    with torch.no_grad():  # other values: the load must bring the saved ones
        for param in model.parameters():
            param.add_(1.0)
    reference = Reference(case, plain)
    replay = Reference(saved, reference.model)
    replay.optimizer = reference.optimizer
    for step in range(steps):
        replay.step(step, saved_data_ranks)
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    try:
        path, _ = engine.load_checkpoint(directory, tag="saved")
        if path is None:
            raise AssertionError(f"no checkpoint loaded from {directory}")
        loaded = check_weights(engine, model, reference, f"{case}: right after loading")
        worst = train_and_compare(case, engine, model, reference, range(steps, steps + 2))
    finally:
        engine.destroy()
    return {"data_parallel_size": engine.data_parallel_size, "loaded": loaded, **worst}


def export_case(stage: int, directory: str) -> dict[str, Any]:
    """After two steps at E=2: `full_parameters()`, `state_dict()` and `save_16bit_model` give
    every expert tensor whole under the model's own names (equal to the reference's), and
    `from_pretrained` loads the saved folder; a checkpoint consolidates to the same tensors."""
    from transformers import AutoModelForCausalLM

    case = Case(stage)
    model, plain = build_pair(case)
    reference = Reference(case, plain)
    config = case.config()
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    try:
        train_and_compare(case, engine, model, reference, range(2))
        expected = {n: p.detach() for n, p in reference.model.named_parameters()}
        streamed = dict(engine.full_parameters())
        state = engine.state_dict()
        engine.save_16bit_model(directory, "model.safetensors")  # streamed, experts whole
        if dist.get_rank() == 0:
            model.config.save_pretrained(directory)
        engine.save_checkpoint(f"{directory}/checkpoint", tag="saved")
        dist.barrier()
        loaded = AutoModelForCausalLM.from_pretrained(directory)
        on_disk = {n: p.detach() for n, p in loaded.named_parameters()}
    finally:
        engine.destroy()
    from zerodp.checkpoint_io.consolidate import full_state_dict_from_checkpoint

    consolidated = full_state_dict_from_checkpoint(f"{directory}/checkpoint", tag="saved")
    worst = 0.0
    for source in (streamed, state, on_disk, consolidated):
        for name, value in expected.items():
            worst = max(worst, close(source[name], value, f"export: {name}"))
    experts = [
        n for n in expected if n.endswith(("gate_up_proj", "down_proj")) and ".experts." in n
    ]
    return {
        "worst": worst,
        "expert_shapes": sorted({int(streamed[n].shape[0]) for n in experts}),
    }


def refused_cases() -> dict[str, str]:
    """What expert parallelism refuses, each message from every rank."""
    out: dict[str, str] = {}
    attempts = {
        "size": {"expert_parallel": {"enabled": True, "autoep_size": 3}},
        "offload": {
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        },
        "preset": {
            "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
        },
        "routing": {"expert_parallel": {"enabled": True, "autoep_size": 2, "top_k": 4}},
    }
    for key, extra in attempts.items():
        config = {**Case(2).config(), **{k: v for k, v in extra.items() if k != "expert_parallel"}}
        config["expert_parallel"] = {
            **config["expert_parallel"],
            **extra.get("expert_parallel", {}),
        }
        try:
            zerodp.initialize(model=build("qwen3_moe"), config=config)
        except zerodp.ConfigError as caught:
            out[key] = str(caught)
    model, _ = build_pair(Case(2, sequence=2, aux=True))
    engine, _, _, _ = zerodp.initialize(model=model, config=Case(2, sequence=2, aux=True).config())
    try:
        ids = micro_batch(0, 0, engine.data_parallel_rank)
        engine(input_ids=ids, labels=ids)
    except zerodp.UsageError as caught:
        out["aux_with_sequence"] = str(caught)
    finally:
        engine.destroy()
    return out


# -- the HF Trainer -------------------------------------------------------------------------

TRAINER_STEPS, TRAINER_MICRO, TRAINER_GAS, TRAINER_LR = 3, 2, 2, 1e-3


class MoETokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Rows of random token ids of the MoE models' vocabulary; labels are the ids."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from tests.hf_moe_models import SEQ_LEN, VOCAB

        generator = torch.Generator().manual_seed(2000 + index)
        ids = torch.randint(3, VOCAB, (SEQ_LEN,), generator=generator)
        return {"input_ids": ids, "labels": ids.clone()}


def trainer_args(output_dir: str, per_device: int) -> Any:
    import transformers

    return transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=TRAINER_GAS,
        max_steps=TRAINER_STEPS,
        learning_rate=TRAINER_LR,
        weight_decay=0.1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )


def trainer_with_experts(workdir: str) -> dict[str, Any]:
    """ZeroDPTrainer at stage 3 with E=2 on 2 ranks: the whole weights after training (from
    `full_parameters`, every expert whole) and the logged losses and norms."""
    from zerodp.integrations.transformers import ZeroDPTrainer

    model, _ = build_pair(Case(3))
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 50},
        "expert_parallel": {"enabled": True, "autoep_size": 2},
        "steps_per_print": 1000,
    }
    trainer = ZeroDPTrainer(
        model=model,
        args=trainer_args(workdir, TRAINER_MICRO),
        train_dataset=MoETokens(),
        zerodp_config=config,
    )
    trainer.train()
    weights = {n: v.detach().clone() for n, v in trainer.engine.full_parameters()}
    logs = [e for e in trainer.state.log_history if "loss" in e]
    trainer.engine.destroy()
    return {"weights": weights, "logs": logs, "steps": trainer.state.global_step}


def plain_trainer_run(workdir: str, world: int) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """transformers' own Trainer in one process on the same batches (world x the batch)."""
    import transformers

    model, _ = build_pair(Case(3))
    trainer = transformers.Trainer(
        model=model,
        args=trainer_args(workdir, TRAINER_MICRO * world),
        train_dataset=MoETokens(),
    )
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, logs


# -- TRL's SFTTrainer -----------------------------------------------------------------------


def trl_moe() -> torch.nn.Module:
    """A tiny Qwen3-MoE over the TRL fixtures' tokenizer (its vocabulary)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.hf_models import VOCAB

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return Qwen3MoeForCausalLM(config)


def sft_trainer(output_dir: str, per_device: int, on_zerodp: bool, experts: int = 2) -> Any:
    import trl

    from tests import trl_fixtures as fx
    from tests.hf_models import SEQ_LEN
    from zerodp.integrations.transformers import with_zerodp

    args = trl.SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=TRAINER_GAS,
        max_steps=TRAINER_STEPS,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        max_length=SEQ_LEN,
        packing=False,
        # TRL turns a MoE model's auxiliary loss on; over two ranks' rows at once (one process)
        # it is not the mean of each rank's own (DDP's, zerodp's): off for this comparison.
        router_aux_loss_coef=0.0,
        bf16=False,
    )
    trainer_class = with_zerodp(trl.SFTTrainer) if on_zerodp else trl.SFTTrainer
    extra: dict[str, Any] = {}
    if on_zerodp:
        extra["zerodp_config"] = {
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"},
            "expert_parallel": {"enabled": experts > 1, "autoep_size": experts},
        }
    return trainer_class(
        model=trl_moe(),
        args=args,
        train_dataset=fx.sft_dataset(64),
        processing_class=fx.build_tokenizer(),
        **extra,
    )


def sft_with_experts(workdir: str, experts: int) -> dict[str, Any]:
    """TRL's SFTTrainer on zerodp (stage 3, E = `experts`) on 2 ranks: whole weights, losses."""
    trainer = sft_trainer(workdir, TRAINER_MICRO, on_zerodp=True, experts=experts)
    trainer.train()
    weights = {n: v.detach().clone() for n, v in trainer.engine.full_parameters()}
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    trainer.destroy_engines()
    return {"weights": weights, "losses": losses}


def sft_single_process(workdir: str, world: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """TRL's own SFTTrainer in one process on the same batches (world x the batch)."""
    trainer = sft_trainer(workdir, TRAINER_MICRO * world, on_zerodp=False)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, losses


# -- a checkpoint inside an accumulation window ------------------------------------------------


def save_inside_window(case: Case, steps: int, directory: str) -> dict[str, float]:
    """Train `steps` steps of `case` (accumulation 2) beside the reference, then the first
    micro-batch of the next window (its backward only), and save inside the window."""
    if case.gas != 2:
        raise ValueError("a window of two micro-batches, saved after the first")
    model, plain = build_pair(case)
    reference = Reference(case, plain)
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    try:
        worst = train_and_compare(case, engine, model, reference, range(steps))
        ids = micro_batch(steps, 0, engine.data_parallel_rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()  # not a boundary: nothing steps
        engine.save_checkpoint(directory, tag="window")
    finally:
        engine.destroy()
    return worst


def resume_inside_window(
    saved: Case, saved_data_ranks: int, steps: int, case: Case, directory: str
) -> dict[str, Any]:
    """Load the window `save_inside_window(saved, steps, ...)` saved, in `case`'s layout (another
    E or stage), run the window's second micro-batch, step, and one more step; the reference
    replays the saved steps and the whole window (the data ranks are the same)."""
    model, plain = build_pair(case)
    with torch.no_grad():  # other values: the load must bring the saved ones
        for param in model.parameters():
            param.add_(1.0)
    reference = Reference(case, plain)
    for step in range(steps):
        reference.step(step, saved_data_ranks)
    engine, _, _, _ = zerodp.initialize(model=model, config=case.config())
    mine = engine.data_parallel_rank
    try:
        path, _ = engine.load_checkpoint(directory, tag="window")
        if path is None:
            raise AssertionError(f"no checkpoint loaded from {directory}")
        losses, norm = reference.step(steps, engine.data_parallel_size)
        ids = micro_batch(steps, 1, mine)
        out = engine(input_ids=ids, labels=ids)
        where = f"{saved} -> {case}, the window's second micro-batch"
        worst = {"loss": close(out.loss, losses[1][mine], f"{where}: loss")}
        engine.backward(out.loss)
        engine.step()
        worst["norm"] = close(engine.get_global_grad_norm(), norm, f"{where}: norm")
        worst["weights"] = check_weights(engine, model, reference, where)
        after = train_and_compare(case, engine, model, reference, range(steps + 1, steps + 2))
        worst = {key: max(value, after[key]) for key, value in worst.items()}
    finally:
        engine.destroy()
    return worst
