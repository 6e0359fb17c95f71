"""Eleven real-style DeepSpeed configs (tests/data/deepspeed/): each trains, or says why not.

The files are written after public configs (HF transformers' and Accelerate's
DeepSpeed test configs, DeepSpeedExamples, DeepSpeed-Chat, the DeepSpeed docs'
examples), "auto" values kept. Each is passed to `zerodp.initialize` the way
its ecosystem would call it (an HF-style run passes a DataLoader, an
optimizer and an LR scheduler, which is what "auto" is filled from) and
trained for 2 optimizer steps at world size 2.

One of them asks for something zerodp does not implement, and must say so
in one `ConfigError` that starts "zerodp does not implement":

| config | why it raises |
|---|---|
| dse_autotuning | the autotuner (`autotuning.enabled: true`) |

The test then makes the one change the message asks for and checks that the
rest of the config trains. dse_bing_bert_squad's Adam without bias correction
(`bias_correction: false`) trains as it is, and is checked against the same
optimizer in one process (`test_adam_without_bias_correction_is_exact`). The four HF and
Accelerate files
(CPU offload of the optimizer, and of the parameters at stage 3) train as
they are once `gradient_clipping`, whose "auto" comes from
TrainingArguments.max_grad_norm (which zerodp alone cannot know; the Trainer
integration fills it), has a number: without one they raise a `ConfigError`
naming the key.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import zerodp
from tests.models import TinyNet, tiny_inputs
from zerodp.errors import ConfigError, ConfigWarning
from zerodp.optim.uncorrected_adam import UncorrectedAdam
from zerodp.utils import safe_get_full_fp32_param

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"

# How each config's ecosystem calls initialize: "hf" passes a DataLoader (micro batch 4),
# an AdamW instance and a LambdaLR on it; "client" passes the optimizer and scheduler only
# (DeepSpeed-Chat); "config" passes nothing but the model (the config builds everything).
TRAINS = {
    "dse_cifar.json": "config",
    "dse_imagenet.json": "config",
    "dse_gan.json": "config",
    "ds_chat_training.json": "client",
    "ds_docs_examples.json": "config",
    "dse_bing_bert_squad.json": "config",
}
NEEDS_CLIPPING = {
    "hf_transformers_zero2.json": "hf",
    "hf_transformers_zero3.json": "hf",
    "accelerate_zero2.json": "hf",
    "accelerate_zero3.json": "hf",
}
RAISES: dict[str, tuple[str, list[str]]] = {
    "dse_autotuning.json": ("hf", ["the autotuner"]),
}


def test_every_config_file_is_covered() -> None:
    assert sorted(p.name for p in DATA.glob("*.json")) == sorted(
        [*TRAINS, *NEEDS_CLIPPING, *RAISES]
    )


def _load(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def _fixed(name: str) -> dict[str, Any]:
    """The config with the change its message asks for."""
    config = _load(name)
    if config.get("gradient_clipping") == "auto":
        config["gradient_clipping"] = 1.0  # TrainingArguments.max_grad_norm's default
    if "autotuning" in config:
        config["autotuning"]["enabled"] = False
    return config


def _arguments(style: str, model: torch.nn.Module) -> dict[str, Any]:
    if style == "config":
        return {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    arguments: dict[str, Any] = {"optimizer": optimizer, "lr_scheduler": scheduler}
    if style == "hf":
        data = TensorDataset(torch.randn(64, 7))
        arguments["training_data"] = DataLoader(data, batch_size=4)
    return arguments


def train_two_steps(config: Any, style: str) -> dict[str, Any]:
    """Runs on every rank; returns what the test checks, from this rank."""
    torch.manual_seed(0)
    model = TinyNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, loader, _ = zerodp.initialize(
            model=model, config=copy.deepcopy(config), **_arguments(style, model)
        )
    notices = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    micro = engine.train_micro_batch_size_per_gpu()
    batches = iter(loader) if loader is not None else None
    for _ in range(2 * engine.gradient_accumulation_steps()):
        if batches is not None:
            (x,) = next(batches)
        else:
            x = torch.randn(micro, 7)
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
    result = {
        "rank": dist.get_rank(),
        "steps": engine.global_steps,
        "skipped": engine.skipped_steps,
        "loss_finite": bool(torch.isfinite(loss)),
        "notices": notices,
        "micro": micro,
    }
    engine.destroy()
    return result


def raises_not_implemented(config: Any, style: str) -> str:
    torch.manual_seed(0)
    model = TinyNet()
    with pytest.raises(ConfigError) as info:
        zerodp.initialize(model=model, config=config, **_arguments(style, model))
    return str(info.value)


def _check_trained(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["steps"] == 2, result
        assert result["loss_finite"], result
        assert result["steps"] > result["skipped"], result  # at least one step was taken
    by_rank = {r["rank"]: r for r in results}
    assert by_rank[1]["notices"] == [], "only rank 0 warns"
    assert len(by_rank[0]["notices"]) <= 1, "at most one config warning"


@pytest.mark.parametrize("name", sorted(TRAINS))
def test_config_trains(pools, name: str) -> None:
    _check_trained(pools(2).run(train_two_steps, _load(name), TRAINS[name]))


@pytest.mark.parametrize("name", sorted(RAISES))
def test_config_names_what_zerodp_does_not_implement(pools, name: str) -> None:
    style, features = RAISES[name]
    for message in pools(2).run(raises_not_implemented, _load(name), style):
        lines = message.splitlines()
        not_implemented = [line for line in lines if line.startswith("zerodp does not implement")]
        assert len(not_implemented) == len(features), message
        for feature, line in zip(features, not_implemented, strict=True):
            assert line.startswith(f"zerodp does not implement {feature}"), message
        assert "unknown config key" not in message and "did you mean" not in message


@pytest.mark.parametrize("name", sorted(RAISES))
def test_config_trains_once_the_named_feature_is_removed(pools, name: str) -> None:
    _check_trained(pools(2).run(train_two_steps, _fixed(name), RAISES[name][0]))


def clipping_is_asked_for(config: Any, style: str) -> str:
    torch.manual_seed(0)
    model = TinyNet()
    with pytest.raises(ConfigError, match="gradient_clipping") as info:
        zerodp.initialize(model=model, config=config, **_arguments(style, model))
    return str(info.value)


@pytest.mark.parametrize("name", sorted(NEEDS_CLIPPING))
def test_hf_configs_train_with_offload_once_clipping_has_a_number(pools, name: str) -> None:
    style = NEEDS_CLIPPING[name]
    for message in pools(2).run(clipping_is_asked_for, _load(name), style):
        assert "zerodp does not implement" not in message, message
    _check_trained(pools(2).run(train_two_steps, _fixed(name), style))


def test_warnings_name_the_keys_without_effect(pools) -> None:
    results = pools(2).run(train_two_steps, _fixed("ds_docs_examples.json"), "config")
    (notice,) = next(r for r in results if r["rank"] == 0)["notices"]
    assert notice.startswith("zerodp: ")
    assert "flops_profiler = " in notice and "torch.profiler" in notice
    assert "comms_logger = " in notice
    assert 'checkpoint.tag_validation = "Warn"' in notice
    assert "activation_checkpointing: " in notice
    assert "zero_optimization.allgather_bucket_size" in notice


def test_hf_auto_values_are_filled_from_the_arguments(pools) -> None:
    results = pools(2).run(train_two_steps, _fixed("hf_transformers_zero3.json"), "hf")
    assert all(r["micro"] == 4 for r in results), "micro batch from the DataLoader"
    (notice,) = next(r for r in results if r["rank"] == 0)["notices"]
    assert "optimizer: unused: the optimizer passed to initialize replaces it" in notice
    assert "scheduler: unused" in notice


def uncorrected_adam_matches_one_process(stage: int) -> float:
    """Adam with `bias_correction: false` at `stage` against zerodp's UncorrectedAdam stepped
    in one process on the gradient averaged over both ranks' batches."""
    torch.manual_seed(0)
    model = TinyNet()
    reference = copy.deepcopy(model)
    params = {"lr": 1e-2, "weight_decay": 0.1, "bias_correction": False, "adam_w_mode": False}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": params},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    optimizer = UncorrectedAdam(
        reference.parameters(), lr=1e-2, weight_decay=0.1, adam_w_mode=False
    )
    for step in range(3):
        engine.backward(engine(tiny_inputs(dist.get_rank(), step)).square().mean())
        engine.step()
        optimizer.zero_grad()
        for rank in range(dist.get_world_size()):
            loss = reference(tiny_inputs(rank, step)).square().mean() / dist.get_world_size()
            loss.backward()
        optimizer.step()
    got = [safe_get_full_fp32_param(p) for p in model.parameters()]
    error = max(
        (g - w).abs().max().item() for g, w in zip(got, reference.parameters(), strict=True)
    )
    engine.destroy()
    return error


@pytest.mark.parametrize("stage", [1, 3])
def test_adam_without_bias_correction_is_exact(pools, stage: int) -> None:
    for error in pools(2).run(uncorrected_adam_matches_one_process, stage):
        assert error < 1e-6, error
