"""The HF Trainer and TRL's SFTTrainer with `"sequence_parallel_size": 2` on 2 ranks, against
the same trainer's own single-process run.

At world size 2 with S = 2 there is one data rank: the two ranks split every sequence of the
batch one process trains on whole, so the reference is the plain `transformers.Trainer` (or
TRL's `SFTTrainer`) in the test process with the same per-device batch, whose sampler visits
the samples in the same order (the engine's own check raises if the two ranks of the sequence
group are handed different batches). Rows are 15 tokens (not a multiple of 2) with the first 8
labels masked, so the first rank's half holds no target: its loss part is 0. Accumulation 2 and
clipping at 0.5 in every case; `average_tokens_across_devices` both ways (the Trainer counts
the tokens of a sequence group once either way).

Compared after 3 steps: every weight (1e-5, fp32: only the order of the additions differs),
every logged loss and grad norm, the tokens seen (`include_num_input_tokens_seen`), and for
SFT its token accuracy and token count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import VOCAB, build_llama, detached, max_abs_difference

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

WORLD = 2
MICRO = 2
GAS = 2
STEPS = 3
LENGTH = 15
MASKED = 8
BOUND = 1e-5
LOGGED = ("loss", "grad_norm", "mean_token_accuracy", "num_tokens", "num_input_tokens_seen")


class MaskedPromptDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Rows of LENGTH random ids whose first MASKED labels are -100 (a prompt)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(5000 + index)
        ids = torch.randint(3, VOCAB, (LENGTH,), generator=generator)
        labels = ids.clone()
        labels[:MASKED] = -100
        return {"input_ids": ids, "labels": labels}


def sft_rows() -> Any:
    from datasets import Dataset

    rows = [MaskedPromptDataset()[i]["input_ids"].tolist() for i in range(32)]
    return Dataset.from_dict({"input_ids": rows})


@dataclass(frozen=True)
class Case:
    name: str
    trainer: str  # "hf" or "sft"
    stage: int
    args: dict[str, Any] = field(default_factory=dict)
    tiled: bool = False  # the MLPs and the loss in tiles of 3 tokens (`tiled_compute`)

    def zerodp_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "sequence_parallel_size": 2,
            "zero_optimization": {"stage": self.stage},
        }
        if self.tiled:
            config["tiled_compute"] = {"mlp": True, "logits_loss": True, "tile_tokens": 3}
        return config


CASES = [
    Case("Trainer, stage 2", "hf", 2, {"include_num_input_tokens_seen": "all"}),
    Case(
        "Trainer, stage 3, tokens not averaged, activation checkpointing, tiled",
        "hf",
        3,
        {"average_tokens_across_devices": False, "gradient_checkpointing": True},
        tiled=True,
    ),
    Case("SFTTrainer, stage 1, tiled", "sft", 1, tiled=True),
]


def trainer_args(case: Case, output_dir: str) -> dict[str, Any]:
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": MICRO,
        "gradient_accumulation_steps": GAS,
        "max_steps": STEPS,
        "learning_rate": 1e-2,
        "adam_epsilon": 1e-4,  # see tests/sequence_setup.py: AdamW's eps above round-off
        "max_grad_norm": 0.5,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "bf16": False,  # TRL's configs default to bf16
        "seed": 0,
        **case.args,
    }


def build(case: Case, output_dir: str, zerodp: bool) -> Any:
    from tests import trl_fixtures as fx
    from zerodp.integrations.transformers import ZeroDPTrainer, with_zerodp

    extra = {"zerodp_config": case.zerodp_config()} if zerodp else {}
    if case.trainer == "hf":
        trainer_class = ZeroDPTrainer if zerodp else transformers.Trainer
        return trainer_class(
            model=build_llama(),
            args=transformers.TrainingArguments(**trainer_args(case, output_dir)),
            train_dataset=MaskedPromptDataset(),
            **extra,
        )
    trainer_class = with_zerodp(trl.SFTTrainer) if zerodp else trl.SFTTrainer
    config = trl.SFTConfig(**trainer_args(case, output_dir), max_length=LENGTH, packing=False)
    return trainer_class(
        model=build_llama(),
        args=config,
        train_dataset=sft_rows(),
        processing_class=fx.build_tokenizer(),
        **extra,
    )


def logged(trainer: Any) -> dict[str, list[float]]:
    history = trainer.state.log_history
    return {key: [e[key] for e in history if key in e] for key in LOGGED}


def sequence_trainer_cases(workdir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from zerodp.utils import safe_get_full_fp32_param

    results: dict[str, Any] = {}
    for index, case in enumerate(CASES):
        dist.barrier()
        trainer = build(case, os.path.join(workdir, f"zerodp-{index}"), zerodp=True)
        trainer.train()
        engine = trainer.engine
        assert engine is not None and engine.global_steps == STEPS, case.name
        assert engine.sequence_parallel is not None and engine.data_parallel_size == 1
        params = {
            n: safe_get_full_fp32_param(p).float().cpu()
            for n, p in trainer.model.named_parameters()
        }
        result = {"params": params, "logged": logged(trainer)}
        trainer.destroy_engines()
        results[case.name] = result if dist.get_rank() == 0 else {}
    return results


def test_trainers_with_sequence_parallelism_match_their_single_process_run(
    pools: Any, tmp_path: Path
) -> None:
    got = pools(WORLD).run(sequence_trainer_cases, str(tmp_path), timeout_s=400)[0]
    for index, case in enumerate(CASES):
        trainer = build(case, str(tmp_path / f"single-{index}"), zerodp=False)
        trainer.train()
        assert trainer.accelerator.num_processes == 1
        expected = detached(trainer.model.named_parameters())
        result = got[case.name]
        diff, where = max_abs_difference(result["params"], expected)
        print(f"{case.name}: max weight diff {diff:.2e} at {where}")
        assert diff <= BOUND, (case.name, diff, where)
        moved, _ = max_abs_difference(expected, detached(build_llama().named_parameters()))
        assert moved > 100 * BOUND, (case.name, "the weights hardly moved", moved)
        for key, values in logged(trainer).items():
            assert len(result["logged"][key]) == len(values), (case.name, key)
            assert result["logged"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), (
                case.name,
                key,
            )
