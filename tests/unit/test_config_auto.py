""" "auto" values: each rule's resolved value, and the error when zerodp cannot know."""

from __future__ import annotations

import json
import re
import types
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerodp.config import AutoHints, load_config, resolve_auto
from zerodp.config.hints import (
    dtype_of,
    hidden_size_of,
    hints_from_arguments,
    micro_batch_size_of,
    optimizer_settings_of,
)
from zerodp.errors import ConfigError, ConfigWarning


def raises(*parts: str) -> Any:
    return pytest.raises(ConfigError, match=".*".join(re.escape(p) for p in parts))


HF_BATCH = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


# --- batch sizes ----------------------------------------------------------------------------


def test_batch_sizes_from_the_data_loader() -> None:
    cfg = load_config(HF_BATCH, 2, hints=AutoHints(micro_batch_size=4))
    b = cfg.batch_sizes
    assert (b.train_batch_size, b.train_micro_batch_size_per_gpu) == (8, 4)
    assert b.gradient_accumulation_steps == 1


def test_train_batch_size_is_micro_times_accumulation_times_data_ranks() -> None:
    auto = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 5,
    }
    assert load_config(auto, 4, hints=AutoHints(world_size=4)).train_batch_size == 60
    # Two tensor-parallel ranks share each batch: 4 ranks are 2 data ranks.
    tensor = {**auto, "tensor_parallel": {"autotp_size": 2}}
    assert load_config(tensor, 4, hints=AutoHints(world_size=4)).train_batch_size == 30


def test_accumulation_from_the_other_two() -> None:
    cfg = load_config(
        {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
        },
        2,
        hints=AutoHints(micro_batch_size=4),
    )
    assert cfg.batch_sizes.gradient_accumulation_steps == 4


def test_micro_batch_without_a_data_loader_is_an_error() -> None:
    with raises(
        "config keys 'train_batch_size', 'train_micro_batch_size_per_gpu', "
        "'gradient_accumulation_steps' are \"auto\", and zerodp cannot tell the micro-batch size",
        "a torch DataLoader",
    ):
        load_config(HF_BATCH, 2)


def test_load_config_without_hints_still_resolves_what_it_can() -> None:
    cfg = load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto"}, 2)
    assert cfg.batch_sizes.train_micro_batch_size_per_gpu == 4


# --- optimizer and scheduler ------------------------------------------------------------------

ADAMW = {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}


def test_optimizer_params_from_the_optimizer_instance() -> None:
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": dict.fromkeys(ADAMW, "auto")},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"},
        },
    }
    hints = AutoHints(optimizer_given=True, optimizer_settings=ADAMW)
    with pytest.warns(ConfigWarning, match="optimizer: unused: the optimizer passed"):
        cfg = load_config(config, 1, hints=hints)
    assert cfg.optimizer is not None and cfg.scheduler is not None
    assert {k: cfg.optimizer.params[k] for k in ADAMW} == {**ADAMW, "betas": (0.8, 0.95)}
    assert cfg.scheduler.params["warmup_min_lr"] == 0.0
    assert cfg.scheduler.params["warmup_max_lr"] == 3e-4


def test_warmup_max_lr_from_the_configs_own_lr() -> None:
    out = resolve_auto(
        {
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
        },
        AutoHints(),
    )
    assert out["scheduler"]["params"]["warmup_max_lr"] == 0.01


def test_optimizer_auto_without_an_instance_is_an_error() -> None:
    with raises(
        "config keys 'optimizer.params.lr', 'optimizer.params.weight_decay' are \"auto\"",
        "zerodp.initialize(optimizer=...)",
    ):
        load_config(
            {
                "train_batch_size": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            },
            1,
        )


def test_blocks_an_instance_replaces_are_dropped_when_it_cannot_fill_them() -> None:
    config = {
        "optimizer": {"type": "AdamW", "params": {"betas": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    }
    hints = AutoHints(optimizer_given=True, optimizer_settings={"lr": 0.1}, lr_scheduler_given=True)
    assert resolve_auto(config, hints) == {}


def test_scheduler_steps_cannot_be_known() -> None:
    with raises(
        "config keys 'scheduler.params.warmup_num_steps', 'scheduler.params.total_num_steps' "
        'are "auto", and zerodp does not know',
        "or pass lr_scheduler=",
    ):
        resolve_auto(
            {
                "scheduler": {
                    "type": "WarmupDecayLR",
                    "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"},
                }
            },
            AutoHints(),
        )


# --- sizes from the model ------------------------------------------------------------------------


def test_bucket_sizes_from_the_hidden_size() -> None:
    zero = {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    }
    out = resolve_auto({"zero_optimization": zero}, AutoHints(hidden_size=768))
    assert out["zero_optimization"] == {
        "stage": 3,
        "reduce_bucket_size": 768 * 768,
        "stage3_prefetch_bucket_size": int(0.9 * 768 * 768),
        "stage3_param_persistence_threshold": 7680,
    }


def test_bucket_sizes_without_a_hidden_size_are_an_error() -> None:
    with raises("config key 'zero_optimization.reduce_bucket_size' is \"auto\"", "set integers"):
        resolve_auto({"zero_optimization": {"reduce_bucket_size": "auto"}}, AutoHints())


@pytest.mark.parametrize(
    ("dtype", "fp16", "bf16"),
    [("fp32", False, False), ("bf16", False, True), ("fp16", True, False)],
)
def test_precision_from_the_model_dtype(dtype: str, fp16: bool, bf16: bool) -> None:
    out = resolve_auto(
        {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, AutoHints(model_dtype=dtype)
    )
    assert (out["fp16"]["enabled"], out["bf16"]["enabled"]) == (fp16, bf16)


def test_precision_without_a_model_is_an_error() -> None:
    with raises("config key 'bf16.enabled' is \"auto\"", "set true or false"):
        resolve_auto({"bf16": {"enabled": "auto"}}, AutoHints())


# --- constants, and what cannot be known ------------------------------------------------------


def test_constant_rules() -> None:
    out = resolve_auto(
        {
            "zero_optimization": {
                "stage3_gather_16bit_weights_on_model_save": "auto",
                "offload_optimizer": {"device": "auto", "nvme_path": "auto"},
            }
        },
        AutoHints(),
    )
    zero = out["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False
    assert zero["offload_optimizer"] == {"device": "none", "nvme_path": None}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"gradient_clipping": "auto"}, "max_grad_norm defaults to 1.0"),
        ({"zero_optimization": {"stage": "auto"}}, "set 0, 1, 2 or 3"),
        (
            {"steps_per_print": "auto"},
            "config key 'steps_per_print' is \"auto\", and zerodp has no rule",
        ),
    ],
)
def test_what_zerodp_cannot_know_is_an_error(config: dict[str, Any], message: str) -> None:
    with raises(message):
        resolve_auto(config, AutoHints())


def test_resolve_auto_does_not_modify_its_input() -> None:
    config = {"fp16": {"enabled": "auto"}, **HF_BATCH}
    snapshot = json.dumps(config)
    resolve_auto(config, AutoHints(model_dtype="fp16", micro_batch_size=2, world_size=1))
    assert json.dumps(config) == snapshot


def test_hints_must_agree_on_the_world_size() -> None:
    with pytest.raises(ValueError, match=re.escape("hints.world_size 4 != world_size 2")):
        load_config({"train_batch_size": 8}, 2, hints=AutoHints(world_size=4))


# --- hints from initialize's arguments --------------------------------------------------------


class _Widest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 40), nn.Linear(40, 2)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"hidden_size": 64}, 64),
        ({"d_model": 32}, 32),
        ({"n_embd": 48}, 48),
        ({"hidden_sizes": [8, 96, 16]}, 96),
        ({"text_config": types.SimpleNamespace(hidden_size=24)}, 24),
    ],
)
def test_hidden_size_from_the_model_config(config: dict[str, Any], expected: int) -> None:
    model = _Widest()
    model.config = types.SimpleNamespace(**config)  # type: ignore[assignment]
    assert hidden_size_of(model) == expected


def test_hidden_size_falls_back_to_the_widest_linear() -> None:
    assert hidden_size_of(_Widest()) == 40
    assert hidden_size_of(nn.ReLU()) is None


def test_dtype_micro_batch_and_optimizer_settings() -> None:
    model = _Widest()
    assert dtype_of(model) == "fp32" and dtype_of(model.to(torch.bfloat16)) == "bf16"
    loader = DataLoader(TensorDataset(torch.zeros(8, 3)), batch_size=4)
    assert micro_batch_size_of(loader) == 4 and micro_batch_size_of(loader.dataset) is None
    settings = optimizer_settings_of(torch.optim.AdamW(model.parameters(), lr=0.5))
    assert settings is not None
    assert settings["lr"] == 0.5 and settings["betas"] == [0.9, 0.999]
    assert optimizer_settings_of(lambda groups: None) is None


def test_hints_from_arguments() -> None:
    model = _Widest()
    hints = hints_from_arguments(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        lr_scheduler=None,
        training_data=None,
        world_size=2,
    )
    assert hints.world_size == 2 and hints.hidden_size == 40 and hints.model_dtype == "fp32"
    assert hints.optimizer_given and not hints.lr_scheduler_given
    assert hints.optimizer_settings is not None and hints.optimizer_settings["lr"] == 0.1


def test_expert_parallelism_enabled_at_size_one_says_it_runs_without_it() -> None:
    config = {"train_batch_size": 2, "expert_parallel": {"enabled": True}}
    with pytest.warns(ConfigWarning, match="autoep_size = 1 with enabled true: every rank holds"):
        parsed = load_config(config, world_size=2)
    assert parsed.expert_parallel.size == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(
            {**config, "expert_parallel": {"enabled": True, "autoep_size": 2}}, world_size=2
        )


def test_deepspeeds_preset_with_an_experts_name_is_refused_naming_what_zerodp_reads() -> None:
    section = {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}
    config = {"train_batch_size": 2, "expert_parallel": {**section, "expert_pattern": "moe"}}
    with pytest.raises(ConfigError, match="zerodp uses no presets and finds the experts by"):
        load_config(config, world_size=2)
