"""ZeroDPTrainer on 2 ranks against the HF Trainer's own single-process run on the same batches.

The reference is the plain `transformers.Trainer` in the test process, with
twice the per-device batch and no DDP: its accelerate-prepared sampler visits
the samples in the same order, so its step k sees exactly the samples the two
ranks see together. Gradient accumulation (2) and activation checkpointing
are on in every case, clipping is active where `max_grad_norm` is 0.5.

fp32: the only difference is the order of the additions (each rank sums its
half of the batch, then the halves are averaged); the plain Trainer under DDP
differs from its single-process run as much as zerodp does, at the same
parameter, in the stage 1 case (`test_the_plain_trainer_under_ddp_is_as_far_from_one_process`),
so the bound is 1e-5 (1% of one AdamW step).
bf16: zerodp trains a bf16 model with fp32 master weights, which the plain
Trainer cannot do (it autocasts an fp32 model), so the reference is that
recipe written as a plain single-process loop (`ReferenceDP` at world size
1) on the plain Trainer's own batches. AdamW moves every element by about
`lr` whatever the gradient's size, so an element whose gradient is within
bf16 round-off of zero may step the other way: the bound is 2 lr per step
for the worst element, and at most 1% of the elements differing by lr/10.

Run with `-s` to see the table of differences.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import (
    TokenDataset,
    build_llama,
    detached,
    fraction_above,
    max_abs_difference,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 4
GAS = 2
MICRO = 2  # per rank; the single-process reference takes 2 x MICRO
WORLD = 2
LR = 1e-3
FP32_BOUND = 1e-5
EVAL_SAMPLES = 8

# A config as people write it for the HF Trainer's DeepSpeed integration.
DEEPSPEED_STYLE = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "reduce_bucket_size": "auto",
    },
    "steps_per_print": 1000,
}
STAGE3 = {
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "reduce_bucket_size": "auto",
    }
}


@dataclass(frozen=True)
class Case:
    name: str
    config: Any  # a dict, or "file" for DEEPSPEED_STYLE written to a JSON file
    args: dict[str, Any] = field(default_factory=dict)
    resume_and_save: bool = False
    samples: int = 64  # with the default 64 the run stops at max_steps, mid-epoch

    @property
    def bf16(self) -> bool:
        return bool(self.args.get("bf16"))

    @property
    def steps(self) -> int:
        if "num_train_epochs" not in self.args:
            return STEPS
        micro_batches = self.samples // (MICRO * WORLD)
        return -(-micro_batches // GAS)  # a short last window still steps


CASES = [
    Case("stage 1", {"zero_optimization": {"stage": 1}}, {"max_grad_norm": 0.5}),
    # One epoch of 9 micro-batches per rank: the fifth step accumulates only one.
    Case(
        "stage 2, DeepSpeed-style file, 1 epoch",
        "file",
        {"weight_decay": 0.0, "warmup_steps": 1, "num_train_epochs": 1, "max_steps": -1},
        samples=36,
    ),
    Case(
        "stage 3",
        STAGE3,
        {"max_grad_norm": 0.5, "eval_strategy": "steps", "eval_steps": 2},
        resume_and_save=True,
    ),
    Case("stage 3, bf16", STAGE3, {"bf16": True}, resume_and_save=False),
    # transformers' Adafactor reads whole tensors: zerodp steps it on whole tensors, exactly.
    Case("stage 2, optim adafactor", {"zero_optimization": {"stage": 2}}, {"optim": "adafactor"}),
]


def training_args(output_dir: str, per_device: int, case: Case, **extra: Any) -> Any:
    values: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": per_device,
        "per_device_eval_batch_size": per_device,
        "gradient_accumulation_steps": GAS,
        "max_steps": STEPS,
        "learning_rate": LR,
        "weight_decay": 0.1,
        "activation_checkpointing": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "seed": 0,
    }
    values.update(case.args)
    values.update(extra)
    return transformers.TrainingArguments(**values)


def config_for(case: Case, workdir: str) -> Any:
    if case.config != "file":
        return copy.deepcopy(case.config)
    path = Path(workdir) / "ds_config.json"
    # Every rank writes the same file: atomically, so that no rank reads another's half-write.
    partial = path.with_name(f"ds_config.{os.getpid()}.partial")
    partial.write_text(json.dumps(DEEPSPEED_STYLE))
    os.replace(partial, path)
    return str(path)


# -- on the 2 ranks ------------------------------------------------------------------------


def full_fp32_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 value (the master weights under bf16); a collective."""
    from zerodp.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).float().cpu() for n, p in model.named_parameters()}


def check_engine_owns_training(trainer: Any) -> None:
    """No DDP, no Accelerate model, no optimizer on the model's parameters, checkpointing on."""
    from torch.nn.parallel import DistributedDataParallel

    from zerodp.integrations.transformers import EngineOptimizer

    model = trainer.model
    assert trainer.model_wrapped is model
    assert not any(isinstance(m, DistributedDataParallel) for m in model.modules())
    assert trainer.accelerator._models == []
    assert isinstance(trainer.optimizer, EngineOptimizer)
    model_params = {id(p) for p in model.parameters()}
    stepped = [p for g in trainer.engine.optimizer.param_groups for p in g["params"]]
    assert stepped and not any(id(p) in model_params for p in stepped)
    assert model.is_activation_checkpointing
    assert trainer.engine.gradient_accumulation_steps() == GAS


def train_case(case: Case, workdir: str) -> tuple[Any, dict[str, Any]]:
    from zerodp.integrations.transformers import ZeroDPTrainer

    out = os.path.join(workdir, "run")
    extra = {"save_strategy": "steps", "save_steps": 2} if case.resume_and_save else {}
    trainer = ZeroDPTrainer(
        model=build_llama(),
        args=training_args(out, MICRO, case, **extra),
        train_dataset=TokenDataset(case.samples),
        eval_dataset=TokenDataset(EVAL_SAMPLES),
        zerodp_config=config_for(case, workdir),
    )
    trainer.train()
    assert trainer.state.global_step == trainer.engine.global_steps == case.steps
    check_engine_owns_training(trainer)
    result: dict[str, Any] = {
        "params": full_fp32_params(trainer.model),
        "logs": trainer.state.log_history,
        "sharded": len(trainer.engine.params.sharded_states),
    }
    return trainer, result


def resume_from_middle(case: Case, workdir: str) -> dict[str, torch.Tensor]:
    """A new model and Trainer that resume from checkpoint-2 and train to step 4."""
    from zerodp.integrations.transformers import ZeroDPTrainer

    checkpoint = os.path.join(workdir, "run", "checkpoint-2")
    expected = {"trainer_state.json", "config.json", "model.safetensors", "latest"}
    expected |= {f"rng_state_{rank}.pth" for rank in range(WORLD)}
    present = set(os.listdir(checkpoint))
    assert expected <= present, sorted(present)
    trainer = ZeroDPTrainer(
        model=build_llama(seed=1),  # different initial weights: the checkpoint must replace them
        args=training_args(os.path.join(workdir, "resumed"), MICRO, case),
        train_dataset=TokenDataset(case.samples),
        eval_dataset=TokenDataset(EVAL_SAMPLES),
        zerodp_config=config_for(case, workdir),
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    assert trainer.state.global_step == case.steps
    return full_fp32_params(trainer.model)


def save_and_reload(trainer: Any, workdir: str) -> dict[str, Any]:
    """save_model, then from_pretrained on rank 0: the same weights and logits.

    Under bf16 zerodp trains with every floating buffer in bf16 (Llama's RoPE
    inv_freq too), while from_pretrained keeps that buffer in fp32: the logits
    are compared as loaded (reported) and with the buffers cast as in training
    (bitwise).
    """
    import torch.distributed as dist
    from safetensors import safe_open

    from tests.hf_models import probe_tokens

    out = os.path.join(workdir, "saved")
    trainer.save_model(out)
    weights = trainer.engine.state_dict(rank0_only=True)
    trainer.model.eval()
    with torch.no_grad():  # every rank: a forward at stage 3 is a collective
        trained = trainer.model(input_ids=probe_tokens()).logits.float()
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    loaded.eval()
    with torch.no_grad():
        as_loaded = loaded(input_ids=probe_tokens()).logits.float()
        for module in loaded.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.is_floating_point():
                    setattr(module, name, buffer.to(loaded.dtype))
        same_buffers = loaded(input_ids=probe_tokens()).logits.float()
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    weights_diff, _ = max_abs_difference(
        detached(loaded.state_dict().items()), detached(weights.items())
    )
    return {
        "weights_diff": weights_diff,
        "logits_diff": (trained - same_buffers).abs().max().item(),
        "logits_diff_as_loaded": (trained - as_loaded).abs().max().item(),
        "keys": keys,
        "model_keys": set(trainer.model.state_dict(keep_vars=True)),
        "dtype": str(loaded.dtype),
        "files": set(os.listdir(out)),
    }


def trainer_cases(workdir: str, names: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    results = {}
    for case in [c for c in CASES if c.name in names]:
        where = os.path.join(workdir, case.name.replace(" ", "_").replace(",", ""))
        os.makedirs(where, exist_ok=True)
        dist.barrier()
        trainer, result = train_case(case, where)
        if case.resume_and_save:
            result["resumed"] = resume_from_middle(case, where)
        result["saved"] = save_and_reload(trainer, where)
        trainer.engine.destroy()
        results[case.name] = result if dist.get_rank() == 0 else {}
    return results


# -- the single-process references --------------------------------------------------------


def plain_trainer(case: Case, workdir: Path) -> tuple[dict[str, torch.Tensor], list[Any]]:
    model = build_llama()
    trainer = transformers.Trainer(
        model=model,
        args=training_args(str(workdir / "plain"), MICRO * WORLD, case),
        train_dataset=TokenDataset(case.samples),
        eval_dataset=TokenDataset(EVAL_SAMPLES),
    )
    trainer.train()
    assert trainer.accelerator.num_processes == 1
    return detached(model.named_parameters()), trainer.state.log_history


def bf16_recipe(case: Case, workdir: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    """zerodp's bf16 recipe in one process: bf16 model, fp32 masters, fp32 accumulation."""
    from transformers.optimization import get_scheduler

    from zerodp.testing import ReferenceDP

    model = build_llama()
    plain = transformers.Trainer(
        model=copy.deepcopy(model),
        args=training_args(str(workdir / "recipe"), MICRO * WORLD, case),
        train_dataset=TokenDataset(case.samples),
    )
    batches = iter(plain.get_train_dataloader())  # the plain Trainer's own order
    decay = set(plain.get_decay_parameter_names(model))
    args = plain.args

    def groups(module: torch.nn.Module) -> list[dict[str, Any]]:
        named = list(module.named_parameters())
        return [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]

    model.activation_checkpointing_enable()
    model.train()
    reference = ReferenceDP(
        model,
        lambda g: torch.optim.AdamW(
            g, lr=LR, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon
        ),
        groups,
        dtype=torch.bfloat16,
        grad_dtype=torch.float32,
    )
    assert reference.optimizer is not None
    schedule = get_scheduler(
        "linear", reference.optimizer, num_warmup_steps=0, num_training_steps=STEPS
    )
    norms = []
    for _ in range(STEPS):
        for _ in range(GAS):
            batch = next(batches)
            reference.run_backward(lambda b=batch: (model(**b).loss / GAS).backward())
        norms.append(
            torch.nn.utils.get_total_norm([reference.grad(p) for p in reference.params]).item()
        )
        reference.step(clip=args.max_grad_norm)
        schedule.step()
        reference.zero_grad()
    masters = {n: reference.master(p).float().clone() for n, p in model.named_parameters()}
    return masters, norms


# -- the test -------------------------------------------------------------------------------


def _step_logs(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if "loss" in entry and "train_loss" not in entry]


def test_zerodp_trainer_matches_plain_trainer(pools, tmp_path: Path) -> None:
    names = [case.name for case in CASES]
    got = pools(WORLD).run(trainer_cases, str(tmp_path), names, timeout_s=240)[0]
    table = ["", "| case | steps | max weight diff | where | bound |", "|---|---|---|---|---|"]
    for case in CASES:
        result = got[case.name]
        assert result["sharded"] > 0 or "stage 3" not in case.name
        if case.bf16:
            expected, norms = bf16_recipe(case, tmp_path)
            diff, where = max_abs_difference(result["params"], expected)
            spread = fraction_above(result["params"], expected, LR / 10)
            bound = f"{2 * LR * STEPS:.0e}; {spread:.2%} of elements > lr/10"
            assert diff <= 2 * LR * STEPS, (case.name, diff, where)
            assert spread <= 0.01, (case.name, spread)
            logged = [e["grad_norm"] for e in _step_logs(result["logs"])]
            torch.testing.assert_close(torch.tensor(logged), torch.tensor(norms), rtol=2e-2, atol=0)
        else:
            expected, logs = plain_trainer(case, tmp_path)
            diff, where = max_abs_difference(result["params"], expected)
            bound = f"{FP32_BOUND:.0e}"
            assert diff <= FP32_BOUND, (case.name, diff, where)
            mine, theirs = _step_logs(result["logs"]), _step_logs(logs)
            assert (
                [e["step"] for e in mine]
                == [e["step"] for e in theirs]
                == list(range(1, case.steps + 1))
            )
            for a, b in zip(mine, theirs, strict=True):
                assert a["learning_rate"] == b["learning_rate"], (case.name, a, b)
                assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (case.name, a, b)
                assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (case.name, a, b)
            evals = [
                [e["eval_loss"] for e in log if "eval_loss" in e] for log in (result["logs"], logs)
            ]
            assert evals[0] == pytest.approx(evals[1], rel=1e-6), (case.name, evals)
            assert len(evals[0]) == (STEPS // 2 if "eval_strategy" in case.args else 0)
        table.append(f"| {case.name} | {case.steps} | {diff:.2e} | {where} | {bound} |")
        if case.resume_and_save:
            resumed, _ = max_abs_difference(result["resumed"], result["params"])
            table.append(
                f"| {case.name}: resumed at step 2 vs uninterrupted | | {resumed:.2e} | | 0 |"
            )
            assert resumed == 0.0, (case.name, "resume is not bitwise", resumed)
        saved = result["saved"]
        table.append(
            f"| {case.name}: save_model + from_pretrained: weights, logits (as loaded) | "
            f"| {saved['weights_diff']:.2e}, {saved['logits_diff']:.2e} "
            f"({saved['logits_diff_as_loaded']:.2e}) | | 0 |"
        )
        assert saved["weights_diff"] == 0.0, (case.name, saved)
        assert saved["logits_diff"] == 0.0, (case.name, saved)
        if not case.bf16:
            assert saved["logits_diff_as_loaded"] == 0.0, (case.name, saved)
        assert {"config.json", "model.safetensors"} <= saved["files"]
        tied = {"lm_head.weight", "model.embed_tokens.weight"}
        assert len(saved["keys"] & tied) == 1, saved["keys"]  # the tied weight written once
        assert saved["keys"] | tied == saved["model_keys"] | tied
        assert saved["dtype"] == ("torch.bfloat16" if case.bf16 else "torch.float32")
    print("\n".join(table))


# -- the plain Trainer under DDP: the same order of additions ------------------------------


def plain_trainer_and_zerodp_on_two_ranks(workdir: str) -> dict[str, dict[str, torch.Tensor]]:
    """The stage 1 case's final weights from the plain Trainer on these ranks (Accelerate
    wraps the model in DDP) and from ZeroDPTrainer, on the same batches."""
    from torch.nn.parallel import DistributedDataParallel

    case = CASES[0]
    model = build_llama()
    plain = transformers.Trainer(
        model=model,
        args=training_args(os.path.join(workdir, "ddp"), MICRO, case),
        train_dataset=TokenDataset(case.samples),
    )
    plain.train()
    assert plain.accelerator.num_processes == WORLD
    assert isinstance(plain.model_wrapped, DistributedDataParallel)
    ddp = detached(model.named_parameters())
    trainer, result = train_case(case, os.path.join(workdir, "zerodp"))
    trainer.engine.destroy()
    return {"ddp": ddp, "zerodp": result["params"]}


def test_the_plain_trainer_under_ddp_is_as_far_from_one_process(pools, tmp_path: Path) -> None:
    """Why FP32_BOUND: DDP itself, each rank summing its half of the batch, ends as far
    from the single-process run as zerodp does (stage 1)."""
    got = pools(WORLD).run(plain_trainer_and_zerodp_on_two_ranks, str(tmp_path), timeout_s=240)[0]
    expected, _ = plain_trainer(CASES[0], tmp_path)
    ddp_diff, ddp_where = max_abs_difference(got["ddp"], expected)
    zerodp_diff, zerodp_where = max_abs_difference(got["zerodp"], expected)
    print(
        f"\nstage 1 against one process: plain Trainer under DDP {ddp_diff:.2e} at {ddp_where}, "
        f"ZeroDPTrainer {zerodp_diff:.2e} at {zerodp_where}"
    )
    assert 0.0 < ddp_diff <= FP32_BOUND, (ddp_diff, ddp_where)  # rounding, and not nothing
    assert zerodp_where == ddp_where, (zerodp_where, ddp_where)
    assert ddp_diff / 2 <= zerodp_diff <= 2 * ddp_diff, (zerodp_diff, ddp_diff)


# -- a model-only checkpoint is not resumed from -----------------------------------------


def resume_from_a_model_only_checkpoint(workdir: str) -> str:
    """Train 2 steps saving with save_only_model=True, then resume from that checkpoint."""
    from zerodp.errors import CheckpointError
    from zerodp.integrations.transformers import ZeroDPTrainer

    case = CASES[0]
    saving = os.path.join(workdir, "model_only")
    trainer = ZeroDPTrainer(
        model=build_llama(),
        args=training_args(
            saving,
            MICRO,
            case,
            max_steps=2,
            save_strategy="steps",
            save_steps=2,
            save_only_model=True,
        ),
        train_dataset=TokenDataset(case.samples),
        zerodp_config=config_for(case, workdir),
    )
    trainer.train()
    trainer.engine.destroy()
    resumed = ZeroDPTrainer(
        model=build_llama(seed=1),
        args=training_args(os.path.join(workdir, "resumed"), MICRO, case),
        train_dataset=TokenDataset(case.samples),
        zerodp_config=config_for(case, workdir),
    )
    with pytest.raises(CheckpointError) as error:
        resumed.train(resume_from_checkpoint=os.path.join(saving, "checkpoint-2"))
    if resumed.engine is not None:
        resumed.engine.destroy()
    return str(error.value)


def test_a_save_only_model_checkpoint_is_refused_for_resume(pools, tmp_path: Path) -> None:
    messages = pools(WORLD).run(resume_from_a_model_only_checkpoint, str(tmp_path))
    assert messages[0] == messages[1]
    assert "holds no zerodp checkpoint" in messages[0], messages[0]
    assert "save_only_model=True" in messages[0], messages[0]
    assert "resume from a checkpoint ZeroDPTrainer saved" in messages[0], messages[0]
