"""Resolve "auto" values the way the HF Trainer does, where zerodp can know the answer.

HF Trainer and Accelerate write "auto" for a dozen keys and fill them from
their own arguments. zerodp has no TrainingArguments, so it fills each one
from what `zerodp.initialize` was given (`AutoHints`): the data loader's
batch size, the optimizer instance's settings, the model's hidden size and
dtype. A value zerodp cannot know (the clipping threshold, the length of the
run) is an error naming the key and what to set; it is never guessed.

| key | filled with |
|---|---|
| train_micro_batch_size_per_gpu | the batch_size of the DataLoader passed as training_data |
| train_batch_size | micro batch x gradient_accumulation_steps ("auto": 1) x data ranks D |
| gradient_accumulation_steps | derived from the other two (1 when they do not fix it) |
| optimizer.params.* | the settings of the optimizer passed to initialize |
| scheduler.params.warmup_min_lr | 0 (HF's constant) |
| scheduler.params.warmup_max_lr | the optimizer's lr |
| zero_optimization.reduce_bucket_size | hidden_size ** 2 |
| zero_optimization.stage3_prefetch_bucket_size | int(0.9 * hidden_size ** 2) |
| zero_optimization.stage3_param_persistence_threshold | 10 * hidden_size |
| zero_optimization.stage3_gather_16bit_weights_on_model_save | false (Accelerate's default) |
| zero_optimization.offload_*.device | "none" (write the device you want) |
| fp16.enabled, bf16.enabled | whether the model's parameters are fp16 / bf16 |

When an optimizer (or LR scheduler) instance is passed, the engine uses it
and the config's block is unused; "auto" values in that block that its
settings cannot fill are then no error, and the block is dropped.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerodp.errors import ConfigError

AUTO = "auto"
_TRAIN = "train_batch_size"
_MICRO = "train_micro_batch_size_per_gpu"
_GAS = "gradient_accumulation_steps"
_HIDDEN_RULES = (
    ("reduce_bucket_size", lambda h: h * h),
    ("stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h)),
    ("stage3_param_persistence_threshold", lambda h: 10 * h),
)


@dataclass(frozen=True)
class AutoHints:
    """What `zerodp.initialize` knows about the run, for filling "auto" values."""

    world_size: int | None = None
    micro_batch_size: int | None = None  # batch_size of a DataLoader passed as training_data
    hidden_size: int | None = None  # model.config.hidden_size / d_model / n_embd, or widest Linear
    optimizer_given: bool = False  # an optimizer instance or factory was passed
    optimizer_settings: Mapping[str, Any] | None = None  # that instance's constructor settings
    lr_scheduler_given: bool = False
    model_dtype: str | None = None  # "fp32", "fp16", "bf16": most of the parameters' dtype


def resolve_auto(data: Mapping[str, Any], hints: AutoHints) -> dict[str, Any]:
    """A copy of `data` with every "auto" replaced; `ConfigError` lists the ones that cannot be."""
    out = copy.deepcopy(dict(data))
    problems: list[str] = []
    _batch_sizes(out, hints, problems)
    _optimizer(out, hints, problems)
    _scheduler(out, hints, problems)
    _zero(out, hints, problems)
    _precision(out, hints, problems)
    if out.get("gradient_clipping") == AUTO:
        del out["gradient_clipping"]
        problems.append(
            f'{_key("gradient_clipping")} is "auto", and zerodp cannot know your clipping '
            "threshold: set a number (the HF Trainer's max_grad_norm defaults to 1.0), or 0 "
            "for no clipping"
        )
    for path in _autos_in(out, ""):
        problems.append(
            f'{_key(path)} is "auto", and zerodp has no rule to fill it: set a value '
            '(docs/configuration.md lists the keys "auto" works for)'
        )
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def _key(path: str) -> str:
    return f"config key '{path}'"


def _keys(paths: list[str]) -> str:
    shown = ", ".join(f"'{p}'" for p in paths)
    return f"config key {shown} is" if len(paths) == 1 else f"config keys {shown} are"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _batch_sizes(out: dict[str, Any], hints: AutoHints, problems: list[str]) -> None:
    autos = [k for k in (_TRAIN, _MICRO, _GAS) if out.get(k) == AUTO]
    if not autos:
        return
    for key in autos:
        del out[key]
    if _MICRO in autos and hints.micro_batch_size is not None:
        out[_MICRO] = hints.micro_batch_size
    # An "auto" train_batch_size is left out: the batch arithmetic derives it from the
    # micro batch, the accumulation and the data ranks (fewer than the world with TP).
    if _TRAIN not in out and _MICRO not in out:
        problems.append(
            f'{_keys(autos)} "auto", and zerodp cannot tell the micro-batch size: set '
            f"'{_MICRO}' to a number (the HF Trainer's per_device_train_batch_size), or pass "
            "training_data= a torch DataLoader (its batch_size is used)"
        )


def _optimizer(out: dict[str, Any], hints: AutoHints, problems: list[str]) -> None:
    optimizer = out.get("optimizer")
    params = optimizer.get("params") if isinstance(optimizer, dict) else None
    if not isinstance(params, dict):
        return
    settings = hints.optimizer_settings or {}
    unresolved = []
    for key in [k for k, v in params.items() if v == AUTO]:
        if key in settings:
            params[key] = copy.deepcopy(settings[key])
        else:
            unresolved.append(key)
    if not unresolved:
        return
    if hints.optimizer_given:
        del out["optimizer"]  # unused: the optimizer passed to initialize replaces it
        return
    for key in unresolved:
        del params[key]
    problems.append(
        f'{_keys([f"optimizer.params.{k}" for k in unresolved])} "auto", and zerodp fills '
        "them only from an optimizer passed to zerodp.initialize(optimizer=...): set numbers "
        "(the HF Trainer's learning_rate, adam_beta1/adam_beta2, adam_epsilon, weight_decay) "
        "or pass optimizer="
    )


def _scheduler(out: dict[str, Any], hints: AutoHints, problems: list[str]) -> None:
    scheduler = out.get("scheduler")
    params = scheduler.get("params") if isinstance(scheduler, dict) else None
    if not isinstance(params, dict):
        return
    if params.get("warmup_min_lr") == AUTO:
        params["warmup_min_lr"] = 0.0
    if params.get("warmup_max_lr") == AUTO:
        lr = _learning_rate(out, hints)
        if lr is not None:
            params["warmup_max_lr"] = lr
    unresolved = [k for k, v in params.items() if v == AUTO]
    if not unresolved:
        return
    if hints.lr_scheduler_given:
        del out["scheduler"]  # unused: the lr_scheduler passed to initialize replaces it
        return
    for key in unresolved:
        del params[key]
    problems.append(
        f'{_keys([f"scheduler.params.{k}" for k in unresolved])} "auto", and zerodp does '
        "not know your learning rate or how long you train: set numbers (steps count "
        "optimizer steps; the HF Trainer derives them from learning_rate, warmup_steps or "
        "warmup_ratio and the number of training steps), or pass lr_scheduler="
    )


def _learning_rate(out: dict[str, Any], hints: AutoHints) -> float | None:
    optimizer = out.get("optimizer")
    lr = optimizer.get("params", {}).get("lr") if isinstance(optimizer, dict) else None
    if isinstance(lr, int | float) and not isinstance(lr, bool):
        return float(lr)
    settings_lr = (hints.optimizer_settings or {}).get("lr")
    return float(settings_lr) if isinstance(settings_lr, int | float) else None


def _zero(out: dict[str, Any], hints: AutoHints, problems: list[str]) -> None:
    zero = out.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    sized = [key for key, _ in _HIDDEN_RULES if zero.get(key) == AUTO]
    if sized and hints.hidden_size is not None:
        for key, rule in _HIDDEN_RULES:
            if key in sized:
                zero[key] = max(1, rule(hints.hidden_size))
    elif sized:
        for key in sized:
            del zero[key]
        problems.append(
            f'{_keys([f"zero_optimization.{k}" for k in sized])} "auto", which HF sizes from '
            "the model's hidden size, and zerodp found none (no config.hidden_size, d_model or "
            "n_embd, and no nn.Linear): set integers"
        )
    if zero.get("stage") == AUTO:
        del zero["stage"]
        problems.append(
            f'{_key("zero_optimization.stage")} is "auto", and zerodp cannot choose the '
            "stage for you: set 0, 1, 2 or 3"
        )
    if zero.get("stage3_gather_16bit_weights_on_model_save") == AUTO:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section)
        if isinstance(offload, dict):
            if offload.get("device") == AUTO:
                offload["device"] = "none"
            if offload.get("nvme_path") == AUTO:
                offload["nvme_path"] = None


def _precision(out: dict[str, Any], hints: AutoHints, problems: list[str]) -> None:
    for section in ("fp16", "bf16"):
        block = out.get(section)
        if not isinstance(block, dict) or block.get("enabled") != AUTO:
            continue
        if hints.model_dtype is None:
            del block["enabled"]
            problems.append(
                f'{_key(f"{section}.enabled")} is "auto", which zerodp takes from the '
                "model's parameter dtype, and it was not given a model: set true or false"
            )
        else:
            block["enabled"] = hints.model_dtype == section


def _autos_in(node: Any, path: str) -> list[str]:
    if node == AUTO:
        return [path]
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            found += _autos_in(value, f"{path}.{key}" if path else str(key))
    return found
