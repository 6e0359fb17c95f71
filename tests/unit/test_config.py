"""zerodp.config: defaults, inputs, batch-size arithmetic and every error message."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from zerodp.config import (
    OptimizerConfig,
    SchedulerConfig,
    WarmupLRParams,
    ZeroDPConfig,
    load_config,
    resolve_batch_sizes,
)
from zerodp.errors import ConfigError


def load(world_size: int = 1, **config: Any) -> ZeroDPConfig:
    return load_config({"train_batch_size": 8 * world_size, **config}, world_size=world_size)


def raises(*parts: str) -> Any:
    """pytest.raises(ConfigError) matching each literal part, in order."""
    return pytest.raises(ConfigError, match=".*".join(re.escape(p) for p in parts))


# --- defaults and inputs ----------------------------------------------------


def test_defaults() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 4}, world_size=1)
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.gradient_clipping == 1.0  # DeepSpeed 0.19.3's default (test_deepspeed_defaults)
    assert cfg.steps_per_print == 10
    assert cfg.communication_data_type is None
    assert cfg.dataloader_drop_last is False and cfg.seed is None
    z = cfg.zero_optimization
    assert z.stage == 0
    assert z.reduce_bucket_size == 500_000_000
    assert z.overlap_comm
    assert z.offload_param is None and z.offload_optimizer is None
    assert z.stage3_param_persistence_threshold == 100_000
    assert z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_max_live_parameters == z.stage3_max_reuse_distance == 1_000_000_000
    assert z.stage3_gather_16bit_weights_on_model_save is False
    assert not cfg.bf16.enabled and not cfg.fp16.enabled
    f = cfg.fp16
    assert (f.loss_scale, f.initial_scale_power, f.loss_scale_window) == (0.0, 16, 1000)
    assert (f.hysteresis, f.min_loss_scale, f.consecutive_hysteresis) == (2, 1.0, False)
    for monitor in (cfg.csv_monitor, cfg.tensorboard):
        assert (monitor.enabled, monitor.output_path, monitor.job_name) == (False, "", "zerodp_job")
    e = cfg.eigenvalue
    assert not e.enabled
    assert (e.max_iter, e.tol, e.stability) == (100, 1e-2, 1e-6)
    assert (e.gas_boundary_resolution, e.layer_name, e.layer_num) == (1, "", 0)


def test_dict_input_is_not_mutated() -> None:
    raw = {"train_batch_size": 8, "optimizer": {"type": "adam", "params": {"lr": 0.5}}}
    snapshot = json.loads(json.dumps(raw))
    cfg = load_config(raw, world_size=2)
    assert raw == snapshot
    assert cfg.optimizer is not None and cfg.optimizer.params["lr"] == 0.5


def test_json_file_input(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": 2}}))
    for source in (path, str(path)):
        cfg = load_config(source, world_size=4)
        assert cfg.zero_optimization.stage == 2
        assert cfg.train_micro_batch_size_per_gpu == 4


def test_config_object_input_is_resolved() -> None:
    cfg = ZeroDPConfig(train_micro_batch_size_per_gpu=2)
    assert cfg.train_batch_size is None
    resolved = load_config(cfg, world_size=3)
    assert resolved.train_batch_size == 6 and resolved.gradient_accumulation_steps == 1
    assert resolved.batch_sizes.train_batch_size == 6


def test_unresolved_batch_sizes_property_names_the_fix() -> None:
    with raises("not resolved", "load_config"):
        _ = ZeroDPConfig().batch_sizes


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with raises(f"config file '{path}' does not exist"):
        load_config(path, world_size=1)


def test_invalid_json_names_path_and_position(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n}\n')
    with raises(f"config file '{path}' is not valid JSON", "line 3 column 1"):
        load_config(path, world_size=1)


def test_duplicate_json_key(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with raises("sets key 'train_batch_size' twice"):
        load_config(path, world_size=1)


def test_json_top_level_must_be_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with raises("got a JSON list", "allowed: a JSON object"):
        load_config(path, world_size=1)


@pytest.mark.parametrize("bad", [5, [("train_batch_size", 8)], None])
def test_config_must_be_a_dict(bad: Any) -> None:
    with raises("config: got", "allowed: a dict, a path to a JSON file, or a ZeroDPConfig"):
        load_config(bad, world_size=1)


def test_non_string_keys() -> None:
    with raises("config keys must be strings: got 1"):
        load_config({1: 2}, world_size=1)  # type: ignore[dict-item]


# --- batch sizes -------------------------------------------------------------


def sizes(t: int | None, m: int | None, g: int | None, w: int) -> tuple[int, int, int]:
    cfg = load_config(
        {
            k: v
            for k, v in (
                ("train_batch_size", t),
                ("train_micro_batch_size_per_gpu", m),
                ("gradient_accumulation_steps", g),
            )
            if v is not None
        },
        world_size=w,
    )
    b = cfg.batch_sizes
    assert (b.train_batch_size, b.train_micro_batch_size_per_gpu) == (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
    )
    return b.train_batch_size, b.train_micro_batch_size_per_gpu, b.gradient_accumulation_steps


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ((32, 4, 2, 4), (32, 4, 2)),  # all three, consistent
        ((32, 4, None, 2), (32, 4, 4)),  # gas derived
        ((32, None, 2, 2), (32, 8, 2)),  # micro derived
        ((None, 4, 2, 2), (16, 4, 2)),  # train derived
        ((32, None, None, 4), (32, 8, 1)),  # only train: gas 1
        ((None, 4, None, 3), (12, 4, 1)),  # only micro: gas 1
    ],
)
def test_batch_size_rules(given: tuple[Any, ...], expected: tuple[int, int, int]) -> None:
    assert sizes(*given) == expected


def test_batch_inconsistent_shows_arithmetic() -> None:
    with raises(
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 x "
        "gradient_accumulation_steps 2 x world size 2 = 16; fix one of the three"
    ):
        sizes(32, 4, 2, 2)


def test_batch_train_and_micro_not_divisible() -> None:
    with raises(
        "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 x "
        "world size 2 = 8 (30 / 8 = 3.75); set train_batch_size to a multiple of 8"
    ):
        sizes(30, 4, None, 2)


def test_batch_train_smaller_than_micro_times_world() -> None:
    with raises("train_batch_size 4 is not divisible by", "= 8 (4 / 8 = 0.5)"):
        sizes(4, 4, None, 2)


def test_batch_train_and_gas_not_divisible() -> None:
    with raises(
        "train_batch_size 30 is not divisible by gradient_accumulation_steps 4 x "
        "world size 2 = 8 (30 / 8 = 3.75)"
    ):
        sizes(30, None, 4, 2)


def test_batch_only_train_not_divisible_by_world() -> None:
    with raises(
        "train_batch_size 10 is not divisible by world size 4 = 4 (10 / 4 = 2.5)",
        "set train_batch_size to a multiple of 4",
    ):
        sizes(10, None, None, 4)


def test_batch_only_gas() -> None:
    with raises("gradient_accumulation_steps 2 alone", "set train_batch_size or train_micro"):
        sizes(None, None, 2, 1)


def test_batch_none_set() -> None:
    with raises("batch size is not set; set train_batch_size or train_micro_batch_size_per_gpu"):
        load_config({}, world_size=1)


@pytest.mark.parametrize("world_size", [0, -1, 1.0, True])
def test_batch_bad_world_size(world_size: Any) -> None:
    with raises("world size: got", "allowed: an integer >= 1"):
        resolve_batch_sizes(8, None, None, world_size)


def test_batch_sizes_must_be_positive() -> None:
    with raises("config key 'train_micro_batch_size_per_gpu': got 0; allowed: an integer >= 1"):
        load_config({"train_micro_batch_size_per_gpu": 0}, world_size=1)


# --- unknown keys ------------------------------------------------------------


def test_unknown_top_level_key_suggests() -> None:
    with raises("unknown config key 'optimiser'; did you mean 'optimizer'?"):
        load(optimiser={"type": "adam"})


def test_unknown_nested_key_suggests() -> None:
    with raises(
        "unknown config key 'zero_optimization.stage3_prefetch_bucket_sze'; "
        "did you mean 'stage3_prefetch_bucket_size'?"
    ):
        load(zero_optimization={"stage3_prefetch_bucket_sze": 5})


def test_unknown_key_without_close_match_lists_allowed() -> None:
    with raises(
        "unknown config key 'fp16.xyzzy'; allowed keys here: consecutive_hysteresis, enabled"
    ):
        load(fp16={"xyzzy": 1})


def test_unknown_optimizer_param_suggests() -> None:
    with raises("unknown config key 'optimizer.params.weight_decya'; did you mean 'weight_decay'?"):
        load(optimizer={"type": "AdamW", "params": {"weight_decya": 0.1}})


def test_unknown_sgd_param_uses_sgd_keys() -> None:
    with raises(
        "unknown config key 'optimizer.params.betas'; allowed keys here: dampening, foreach"
    ):
        load(optimizer={"type": "SGD", "params": {"betas": [0.9, 0.99]}})


def test_unknown_scheduler_param_suggests() -> None:
    with raises("unknown config key 'scheduler.params.warmup_num_step'; did you mean"):
        load(scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 10}})


def test_several_errors_are_all_reported() -> None:
    with pytest.raises(ConfigError) as info:
        load(steps_per_print=0, zero_optimization={"stage": 9, "overlap_com": True})
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    assert any("'steps_per_print': got 0" in line for line in lines)
    assert any("'zero_optimization.stage': got 9" in line for line in lines)
    assert any("did you mean 'overlap_comm'" in line for line in lines)


# --- wrong types and ranges --------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"zero_optimization": {"stage": 4}},
            "'zero_optimization.stage': got 4; allowed: 0, 1, 2 or 3",
        ),
        ({"zero_optimization": {"stage": True}}, "'zero_optimization.stage': got True; allowed"),
        ({"zero_optimization": {"stage": "2"}}, "'zero_optimization.stage': got '2'; allowed"),
        ({"zero_optimization": 3}, "'zero_optimization': got 3; allowed: a JSON object"),
        (
            {"zero_optimization": {"reduce_bucket_size": 1.5}},
            "'zero_optimization.reduce_bucket_size': got 1.5; allowed: an integer >= 1",
        ),
        (
            {"zero_optimization": {"stage3_prefetch_bucket_size": -1}},
            "'zero_optimization.stage3_prefetch_bucket_size': got -1; allowed: an integer >= 0",
        ),
        ({"gradient_clipping": -1.0}, "'gradient_clipping': got -1.0; allowed: a number >= 0"),
        ({"gradient_clipping": "1"}, "'gradient_clipping': got '1'; allowed: a number >= 0"),
        ({"steps_per_print": 0}, "'steps_per_print': got 0; allowed: an integer >= 1"),
        ({"bf16": {"enabled": "true"}}, "'bf16.enabled': got 'true'; allowed: true or false"),
        ({"fp16": {"enabled": 1}}, "'fp16.enabled': got 1; allowed: true or false"),
        ({"fp16": {"min_loss_scale": 0}}, "'fp16.min_loss_scale': got 0; allowed: a number > 0"),
        ({"fp16": {"hysteresis": 0}}, "'fp16.hysteresis': got 0; allowed: an integer >= 1"),
        (
            {"csv_monitor": {"output_path": 3}},
            "'csv_monitor.output_path': got 3; allowed: a string",
        ),
        ({"eigenvalue": {"tol": 0}}, "'eigenvalue.tol': got 0; allowed: a number > 0"),
        ({"eigenvalue": {"max_iter": 0}}, "'eigenvalue.max_iter': got 0; allowed: an integer >= 1"),
        (
            {"communication_data_type": "fp8"},
            "'communication_data_type': got 'fp8'; allowed: 'fp32', 'fp16' or 'bf16'",
        ),
        ({"seed": -3}, "'seed': got -3; allowed: an integer >= 0"),
        (
            {"dataloader_drop_last": "no"},
            "'dataloader_drop_last': got 'no'; allowed: true or false",
        ),
        (
            {"optimizer": {"type": "Adamm"}},
            "'optimizer.type': got 'Adamm'; allowed: 'Adam', 'AdamW', 'SGD', 'Adagrad', "
            "'Adamax', 'RMSprop', 'Muon', 'Lamb' or 'Lion'",
        ),
        (
            {"optimizer": {"type": "Adam", "params": 3}},
            "'optimizer.params': got 3; allowed: a JSON object",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"lr": 0}}},
            "'optimizer.params.lr': got 0; allowed: a number > 0",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}},
            "'optimizer.params.betas': got [0.9, 1.0]; allowed: a list of two numbers in [0, 1)",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
            "'optimizer.params.betas': got [0.9]; allowed: a list of two numbers",
        ),
        (
            {"optimizer": {"type": "SGD", "params": {"momentum": -0.1}}},
            "'optimizer.params.momentum': got -0.1; allowed: a number >= 0",
        ),
        (
            {"scheduler": {"type": "Cosine"}},
            "'scheduler.type': got 'Cosine'; allowed: 'WarmupLR', 'WarmupDecayLR' or",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}},
            "'scheduler.params.warmup_type': got 'cos'; allowed: 'log' or 'linear'",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
            "'scheduler.params.warmup_num_steps': got 0; allowed: an integer >= 1",
        ),
        (
            {
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 9, "cos_min_ratio": 1},
                }
            },
            "'scheduler.params.cos_min_ratio': got 1; allowed: a number in [0, 1)",
        ),
    ],
)
def test_wrong_type_or_range(config: dict[str, Any], message: str) -> None:
    with raises(f"config key {message}"):
        load(**config)


def test_non_finite_float_rejected() -> None:
    with raises("'gradient_clipping': got nan; allowed: a number >= 0"):
        load(gradient_clipping=float("nan"))


def test_missing_optimizer_type() -> None:
    with raises("missing required config key 'optimizer.type'; add it (one of 'Adam'"):
        load(optimizer={"params": {}})


def test_missing_total_num_steps() -> None:
    with raises("missing required config key 'scheduler.params.total_num_steps'; add it"):
        load(scheduler={"type": "WarmupDecayLR", "params": {}})


def test_sgd_nesterov_needs_momentum() -> None:
    with raises("'optimizer.params.nesterov': got True while 'optimizer.params.momentum' is 0"):
        load(optimizer={"type": "SGD", "params": {"nesterov": True}})
    cfg = load(optimizer={"type": "SGD", "params": {"nesterov": True, "momentum": 0.9}})
    assert cfg.optimizer is not None and cfg.optimizer.params["nesterov"] is True


def test_bf16_and_fp16_conflict() -> None:
    with raises("config keys 'bf16.enabled' and 'fp16.enabled' are both true", "set one of them"):
        load(bf16={"enabled": True}, fp16={"enabled": True})


def test_direct_construction_raises_config_error() -> None:
    with raises("config key 'zero_optimization.stage': got 5"):
        ZeroDPConfig(zero_optimization={"stage": 5})
    with raises("config key 'type': got 'x'"):
        OptimizerConfig.from_dict({"type": "x"})
    with raises("config key 'warmup_num_steps': got 0"):
        WarmupLRParams.from_dict({"warmup_num_steps": 0})


# --- conversions -------------------------------------------------------------


def test_scientific_notation_ints() -> None:
    cfg = load(
        zero_optimization={
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_max_live_parameters": 1e9,
            "stage": 3.0,
        },
        steps_per_print=1e2,
    )
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 500_000_000 and type(z.reduce_bucket_size) is int
    assert z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_max_live_parameters == 1_000_000_000
    assert z.stage == 3 and type(z.stage) is int
    assert cfg.steps_per_print == 100


def test_scientific_notation_in_json_file(tmp_path: Path) -> None:
    path = tmp_path / "sci.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 5e8}}')
    assert load_config(path, world_size=1).zero_optimization.reduce_bucket_size == 500_000_000


def test_ints_accepted_for_floats() -> None:
    cfg = load(gradient_clipping=1, optimizer={"type": "Adam", "params": {"lr": 1}})
    assert cfg.gradient_clipping == 1.0 and type(cfg.gradient_clipping) is float
    assert cfg.optimizer is not None and type(cfg.optimizer.params["lr"]) is float


def test_communication_data_type_case_insensitive() -> None:
    assert load(communication_data_type="BF16").communication_data_type == "bf16"


def test_frozen() -> None:
    cfg = load(zero_optimization={"stage": 1})
    with pytest.raises(ValidationError):
        cfg.train_batch_size = 3
    with pytest.raises(ValidationError):
        cfg.zero_optimization.stage = 2


def test_dump_round_trips() -> None:
    cfg = load(
        world_size=2,
        optimizer={"type": "adamw", "params": {"lr": 3e-4}},
        scheduler={"type": "warmupcosinelr", "params": {"total_num_steps": 5000}},
        zero_optimization={"stage": 2},
    )
    again = load_config(json.loads(cfg.model_dump_json()), world_size=2)
    assert again == cfg


# --- optimizer and scheduler types --------------------------------------------


@pytest.mark.parametrize(
    ("given", "canonical"), [("adam", "Adam"), ("ADAMW", "AdamW"), ("sgd", "SGD"), ("Adam", "Adam")]
)
def test_optimizer_type_case_insensitive(given: str, canonical: str) -> None:
    cfg = load(optimizer={"type": given})
    assert cfg.optimizer is not None and cfg.optimizer.type == canonical


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("warmuplr", "WarmupLR"),
        ("WARMUPDECAYLR", "WarmupDecayLR"),
        ("warmupCosineLR", "WarmupCosineLR"),
    ],
)
def test_scheduler_type_case_insensitive(given: str, canonical: str) -> None:
    params = {} if canonical == "WarmupLR" else {"total_num_steps": 2000}
    cfg = load(scheduler={"type": given, "params": params})
    assert cfg.scheduler is not None and cfg.scheduler.type == canonical


def test_scheduler_params_defaults_filled() -> None:
    sched = SchedulerConfig.from_dict({"type": "WarmupLR"})
    assert sched.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,  # DeepSpeed's WarmupLR: each param group's own lr
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    }
    cosine = SchedulerConfig.from_dict(
        {"type": "WarmupCosineLR", "params": {"total_num_steps": 2e3}}
    )
    assert cosine.params["total_num_steps"] == 2000
    assert cosine.params["warmup_min_ratio"] == 0.0 and cosine.params["cos_min_ratio"] == 1e-4


def test_adam_defaults_map_to_torch_adamw() -> None:
    opt = OptimizerConfig.from_dict({"type": "Adam"})
    name, kwargs = opt.torch_kwargs()
    assert name == "AdamW"
    assert kwargs == {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "amsgrad": False,
    }


def test_adam_without_w_mode_maps_to_torch_adam() -> None:
    opt = OptimizerConfig.from_dict(
        {"type": "Adam", "params": {"adam_w_mode": False, "betas": [0.8, 0.9]}}
    )
    name, kwargs = opt.torch_kwargs()
    assert name == "Adam"
    assert kwargs["betas"] == (0.8, 0.9) and isinstance(kwargs["betas"], tuple)
    assert "adam_w_mode" not in kwargs


@pytest.mark.parametrize("w_mode", [True, False])
def test_adamw_ignores_w_mode(w_mode: bool) -> None:
    opt = OptimizerConfig.from_dict({"type": "adamw", "params": {"adam_w_mode": w_mode}})
    assert opt.torch_kwargs()[0] == "AdamW"


def test_sgd_torch_kwargs() -> None:
    opt = OptimizerConfig.from_dict(
        {"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}
    )
    assert opt.torch_kwargs() == (
        "SGD",
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": True},
    )


def test_torch_kwargs_build_real_optimizers() -> None:
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.zeros(3))
    for raw in (
        {"type": "Adam"},
        {"type": "Adam", "params": {"adam_w_mode": False}},
        {"type": "SGD"},
    ):
        name, kwargs = OptimizerConfig.from_dict(raw).torch_kwargs()
        opt = getattr(torch.optim, name)([param], **kwargs)
        assert type(opt).__name__ == name
