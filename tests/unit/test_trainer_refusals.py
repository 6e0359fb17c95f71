"""ZeroDPTrainer refuses what it cannot honour, with an error naming the fix.

Every refusal here happens before the engine (and a process group) exists,
so these run in the test process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import TokenDataset, build_llama
from zerodp.errors import ConfigError, UsageError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def trainer(tmp_path: Path, config: Any = None, **kwargs: Any) -> Any:
    from zerodp.integrations.transformers import ZeroDPTrainer

    optimizers = kwargs.pop("optimizers", (None, None))
    model = kwargs.pop("model", None) or build_llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **kwargs,
    )
    return ZeroDPTrainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(8),
        eval_dataset=TokenDataset(4),
        optimizers=optimizers,
        zerodp_config=config if config is not None else {"zero_optimization": {"stage": 2}},
    )


def test_the_config_is_required(tmp_path: Path) -> None:
    from zerodp.integrations.transformers import ZeroDPTrainer

    with pytest.raises(ConfigError, match="needs zerodp_config="):
        ZeroDPTrainer(model=build_llama(), args=transformers.TrainingArguments(str(tmp_path)))
    with pytest.raises(ConfigError, match="cannot read zerodp_config"):
        trainer(tmp_path, config=str(tmp_path / "missing.json"))


def test_arguments_that_would_rebuild_or_rewrap_the_model_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="auto_find_batch_size"):
        trainer(tmp_path, auto_find_batch_size=True)


def test_torch_compile_is_said_to_have_no_effect(tmp_path: Path) -> None:
    from zerodp.errors import ConfigWarning

    with pytest.warns(ConfigWarning, match="torch_compile=True\\) has no effect"):
        trainer(tmp_path, torch_compile=True)


def test_refusals_at_train(tmp_path: Path) -> None:
    cases = [
        (
            {"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps"},
            None,
            "steps on an evaluation metric",
        ),
        (
            {},
            {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}},
            "'train_micro_batch_size_per_gpu' is 8, but TrainingArguments",
        ),
    ]
    for kwargs, config, message in cases:
        with pytest.raises(ConfigError, match=message):
            trainer(tmp_path, config=config, **kwargs).train()


def test_an_optimizer_passed_twice_is_refused(tmp_path: Path) -> None:
    model = build_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
    }
    with pytest.raises(ConfigError, match="'optimizer' block and the Trainer was given"):
        trainer(
            tmp_path, config=config, model=model, optimizers=(optimizer, None), learning_rate=1e-3
        ).train()


def test_the_optimizer_is_zerodps_to_build(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="builds its optimizer inside zerodp at train"):
        trainer(tmp_path).create_optimizer()
