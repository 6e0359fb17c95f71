"""TRL's SFTTrainer, DPOTrainer and GRPOTrainer on zerodp (`with_zerodp`) at world size 2.

Each is compared with the same TRL trainer run in the test process on the
global batch (per-device batch x 2, no DDP), whose accelerate-prepared
sampler visits the samples in the same order, after 3 optimizer steps with
accumulation 2 and clipping at 0.5: the largest weight difference is the
order of the additions only (fp32, bound 1e-5 as in test_hf_trainer).

- SFT: full fine-tuning on fixed-length rows, stages 1 and 3.
- DPO: stage 1 with a reference model (a plain replicated model, as TRL's
  `prepare_deepspeed` keeps it below stage 3), and stage 3 with LoRA (the
  reference is the frozen copy of the initial adapter, "ref", that TRL adds
  to a PEFT policy: frozen parameters sharded next to the trained ones).
- GRPO: stages 1 and 3, generation with HF `generate` (no vLLM). Sampling is
  made reproducible across process layouts without losing randomness:
  completion k of a prompt is sampled by the Gumbel-max trick with noise
  seeded by (k, the tokens so far) (`tests/trl_fixtures.py`), so one process
  on the global batch draws the same completions as the two ranks.

Run with `-s` to see the table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import SEQ_LEN, build_llama, detached, max_abs_difference

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

WORLD = 2
MICRO = 2
GAS = 2
STEPS = 3
BOUND = 1e-5
NUM_GENERATIONS = 2


@dataclass(frozen=True)
class Case:
    name: str
    trainer: str  # "sft", "dpo" or "grpo"
    stage: int
    lora: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def zerodp_config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = "auto"  # the matrices are sharded
        return {"zero_optimization": zero}


CASES = [
    Case("SFT, stage 1", "sft", 1),
    Case("SFT, stage 3", "sft", 3),
    Case("DPO, stage 1, reference model", "dpo", 1),
    Case("DPO, stage 3, LoRA (reference: a frozen copy of the adapter)", "dpo", 3, lora=True),
    Case("GRPO, stage 1", "grpo", 1),
    Case("GRPO, stage 3", "grpo", 3),
]


def common_args(output_dir: str, per_device: int) -> dict[str, Any]:
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": GAS,
        "max_steps": STEPS,
        "learning_rate": 1e-2,
        "max_grad_norm": 0.5,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "bf16": False,
        "seed": 0,
    }


def lora(model: torch.nn.Module) -> Any:
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def build_trainer(case: Case, output_dir: str, per_device: int, trainer_class: Any) -> Any:
    """The case's TRL trainer: `trainer_class` is TRL's class or `with_zerodp` of it."""
    from tests import trl_fixtures as fx

    args = common_args(output_dir, per_device)
    from zerodp.integrations.transformers import ZeroDPTrainer

    on_zerodp = issubclass(trainer_class, ZeroDPTrainer)
    zerodp_kwargs = {"zerodp_config": case.zerodp_config} if on_zerodp else {}
    tokenizer = fx.build_tokenizer()
    if case.trainer == "sft":
        config = trl.SFTConfig(**args, max_length=SEQ_LEN, packing=False)
        return trainer_class(
            model=build_llama(),
            args=config,
            train_dataset=fx.sft_dataset(64),
            processing_class=tokenizer,
            **zerodp_kwargs,
        )
    if case.trainer == "dpo":
        config = trl.DPOConfig(**args, max_length=SEQ_LEN, beta=0.1)
        model = lora(build_llama()) if case.lora else build_llama()
        ref_model = None if case.lora else build_llama()
        return trainer_class(
            model=model,
            ref_model=ref_model,
            args=config,
            train_dataset=fx.dpo_dataset(64),
            processing_class=tokenizer,
            **zerodp_kwargs,
        )
    config = trl.GRPOConfig(
        **args,
        num_generations=NUM_GENERATIONS,
        max_completion_length=6,
        beta=0.0,
        generation_kwargs={"do_sample": False},  # the Gumbel noise samples (tests/trl_fixtures)
    )
    return trainer_class(
        model=fx.build_gumbel_llama(NUM_GENERATIONS),
        reward_funcs=fx.low_ids_reward,
        args=config,
        train_dataset=fx.grpo_dataset(64),
        processing_class=tokenizer,
        **zerodp_kwargs,
    )


TRAINERS = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "grpo": "GRPOTrainer"}


# -- on the 2 ranks ------------------------------------------------------------------------


def trl_cases(workdir: str, names: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    from zerodp.integrations.transformers import with_zerodp
    from zerodp.utils import safe_get_full_fp32_param

    results: dict[str, Any] = {}
    for case in [c for c in CASES if c.name in names]:
        dist.barrier()
        trainer_class = with_zerodp(getattr(trl, TRAINERS[case.trainer]))
        out = os.path.join(workdir, f"{case.trainer}-{case.stage}")
        trainer = build_trainer(case, out, MICRO, trainer_class)
        trainer.train()
        engine = trainer.engine
        assert engine is not None and engine.global_steps == STEPS, case.name
        assert trainer.model_wrapped is trainer.model
        params = {
            n: safe_get_full_fp32_param(p).float().cpu()
            for n, p in trainer.model.named_parameters()
            if p.requires_grad
        }
        result = {
            "params": params,
            "sharded": len(engine.params.sharded_states),
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        }
        trainer.destroy_engines()
        results[case.name] = result if dist.get_rank() == 0 else {}
    return results


# -- the test -------------------------------------------------------------------------------


def initial_trainable(case: Case) -> dict[str, torch.Tensor]:
    model = lora(build_llama()) if case.lora else build_llama()
    return detached((n, p) for n, p in model.named_parameters() if p.requires_grad)


def single_process(case: Case, workdir: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    trainer_class = getattr(trl, TRAINERS[case.trainer])
    trainer = build_trainer(case, str(workdir / case.trainer), MICRO * WORLD, trainer_class)
    trainer.train()
    assert trainer.accelerator.num_processes == 1
    params = detached((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return params, losses


def test_trl_trainers_on_zerodp_match_single_process_trl(pools, tmp_path: Path) -> None:
    names = [case.name for case in CASES]
    got = pools(WORLD).run(trl_cases, str(tmp_path), names, timeout_s=400)[0]
    table = ["", "| trainer | steps | max weight diff | where |", "|---|---|---|---|"]
    for case in CASES:
        result = got[case.name]
        expected, losses = single_process(case, tmp_path)
        diff, where = max_abs_difference(result["params"], expected)
        table.append(f"| {case.name} | {STEPS} | {diff:.2e} | {where} |")
        print(table[-1])
        assert diff <= BOUND, (case.name, diff, where)
        # GRPO's loss is ~1e-8 (advantages sum to zero per group), hence the absolute term.
        assert result["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6), case.name
        moved, _ = max_abs_difference(expected, initial_trainable(case))
        assert moved > 100 * BOUND, (case.name, "the weights hardly moved", moved)
        assert (result["sharded"] > 0) == (case.stage == 3), case.name
    print("\n".join(table))
