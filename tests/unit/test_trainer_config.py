"""trainer_config: a DeepSpeed-style config completed from TrainingArguments, HF's rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from zerodp.config import AutoHints, load_config
from zerodp.errors import ConfigError
from zerodp.integrations.trainer_config import TrainerValues, trainer_config

VALUES = TrainerValues(
    micro_batch_size=4,
    gradient_accumulation_steps=2,
    world_size=2,
    max_grad_norm=1.0,
    learning_rate=3e-4,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
    warmup_steps=10,
    num_training_steps=100,
    fp16=False,
    bf16=True,
)

HF_STYLE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"},
}


def test_every_auto_the_arguments_decide_is_filled() -> None:
    out = trainer_config(HF_STYLE, VALUES)
    assert out["train_micro_batch_size_per_gpu"] == 4
    assert out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 16
    assert out["gradient_clipping"] == 1.0
    assert out["optimizer"]["params"] == {
        "lr": 3e-4,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    assert out["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 10,
        "total_num_steps": 100,
    }
    assert out["fp16"] == {"enabled": False}
    assert out["bf16"] == {"enabled": True}
    # zerodp's own "auto" (from the model's hidden size) is left to initialize.
    assert out["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"
    assert HF_STYLE["gradient_clipping"] == "auto"  # the caller's dict is not changed
    parsed = load_config(out, world_size=2, hints=AutoHints(hidden_size=32))
    assert parsed.zero_optimization.stage3_prefetch_bucket_size == int(0.9 * 32 * 32)


def test_absent_batch_clipping_and_precision_keys_come_from_the_arguments() -> None:
    out = trainer_config({"zero_optimization": {"stage": 2}}, VALUES)
    assert out == {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 16,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},  # fp16 is off in the arguments and absent: left out
    }


def test_explicit_values_that_agree_are_kept_and_scheduler_lengths_are_not_checked() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 50}},
        "bf16": {"enabled": True},
    }
    out = trainer_config(config, VALUES)
    assert out["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95]}  # absent: left out
    assert out["scheduler"]["params"] == {"warmup_num_steps": 50}


def test_every_disagreement_is_listed_in_one_error() -> None:
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 64,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "fp16": {"enabled": True},
    }
    with pytest.raises(ConfigError) as caught:
        trainer_config(config, VALUES)
    message = str(caught.value)
    args = "TrainingArguments"
    for line in (
        f"'train_micro_batch_size_per_gpu' is 8, but {args}.per_device_train_batch_size is 4",
        f"'gradient_accumulation_steps' is 1, but {args}.gradient_accumulation_steps is 2",
        "'train_batch_size' is 64",
        f"'gradient_clipping' is 0.5, but {args}.max_grad_norm is 1.0",
        f"'optimizer.params.lr' is 0.001, but {args}.learning_rate is 0.0003",
        f"'fp16.enabled' is true, but {args}.fp16 is false",
    ):
        assert line in message, (line, message)
    # bf16 is absent from the config and on in the arguments: filled, not a disagreement.
    assert "'bf16.enabled'" not in message
    assert '"auto"' in message


def test_a_json_file_is_read_and_a_bad_one_named(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_STYLE))
    assert trainer_config(str(path), VALUES)["train_batch_size"] == 16
    with pytest.raises(ConfigError, match="cannot read zerodp_config"):
        trainer_config(tmp_path / "missing.json", VALUES)
    path.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        trainer_config(path, VALUES)
    with pytest.raises(ConfigError, match="must be a dict or the path"):
        trainer_config(3, VALUES)


def test_values_are_read_from_real_training_arguments(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        gradient_accumulation_steps=5,
        learning_rate=2e-4,
        warmup_steps=0.1,  # a ratio of the run
        max_grad_norm=0.7,
        report_to=[],
    )
    values = TrainerValues.from_args(args, num_training_steps=50, world_size=4)
    assert values.micro_batch_size == 3
    assert values.gradient_accumulation_steps == 5
    assert values.learning_rate == 2e-4
    assert values.max_grad_norm == 0.7
    assert values.warmup_steps == args.get_warmup_steps(50) == 5
    assert (values.fp16, values.bf16) == (False, False)
