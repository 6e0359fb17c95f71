"""Load and validate a zerodp config.

`load_config` is the one entry point the engine uses: it accepts what a user
hands to `initialize` (a dict, a JSON file path, or an already built
`ZeroDPConfig`), validates it, resolves the batch sizes for the world size,
and returns a frozen config. It is purely local and deterministic, so every
rank can call it before the first collective and fail the same way.

A DeepSpeed config goes through three steps before validation: its older key
names are rewritten and the keys that change nothing here are dropped
(`compat`), and its "auto" values are filled from `AutoHints` (`auto`).
Every problem those steps find is reported in one `ConfigError`; the keys
accepted without effect are reported in one `ConfigWarning`, on rank 0.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeAlias

from zerodp.config.auto import AutoHints, resolve_auto
from zerodp.config.batch import BatchSizes, resolve_batch_sizes
from zerodp.config.deepspeed_keys import Notice, format_notice, translate
from zerodp.config.model import (
    BF16Config,
    CompileConfig,
    EigenvalueConfig,
    FP16Config,
    MonitorConfig,
    ZeroConfig,
    ZeroDPConfig,
    ZeroOptimizationConfig,
)
from zerodp.config.offload import OffloadConfig, OffloadOptimizerConfig, OffloadParamConfig
from zerodp.config.optimizer import AdamParams, OptimizerConfig, SGDParams
from zerodp.config.scheduler import (
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from zerodp.config.shown_values import show_value
from zerodp.errors import ConfigError, ConfigWarning
from zerodp.parallel import size_problems

__all__ = [
    "AdamParams",
    "AutoHints",
    "BF16Config",
    "BatchSizes",
    "CompileConfig",
    "ConfigError",
    "ConfigSource",
    "ConfigWarning",
    "EigenvalueConfig",
    "FP16Config",
    "MonitorConfig",
    "OffloadConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SGDParams",
    "SchedulerConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "ZeroConfig",
    "ZeroDPConfig",
    "ZeroOptimizationConfig",
    "load_config",
    "resolve_auto",
    "resolve_batch_sizes",
]

ConfigSource: TypeAlias = "Mapping[str, Any] | str | os.PathLike[str] | ZeroDPConfig"


def load_config(
    config: ConfigSource,
    world_size: int,
    *,
    hints: AutoHints | None = None,
    rank: int = 0,
) -> ZeroDPConfig:
    """Validate `config` and return it frozen, with all three batch sizes resolved.

    `hints` fill "auto" values (without them, only the batch sizes and the
    constant rules can be filled); `rank` 0 emits the warning listing the
    DeepSpeed keys that were accepted without effect, other ranks stay quiet.
    """
    if isinstance(config, ZeroDPConfig):
        parsed = config
    else:
        parsed = _parse(_as_dict(config), _hints_for(hints, world_size), rank)
    sizes = resolve_batch_sizes(
        parsed.train_batch_size,
        parsed.train_micro_batch_size_per_gpu,
        parsed.gradient_accumulation_steps,
        world_size,
        parsed.sequence_parallel_size,
        parsed.tensor_parallel.size,
    )
    _check_parallel_sizes(parsed, world_size)
    return parsed.model_copy(
        update={
            "train_batch_size": sizes.train_batch_size,
            "train_micro_batch_size_per_gpu": sizes.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": sizes.gradient_accumulation_steps,
        }
    )


def _check_parallel_sizes(parsed: ZeroDPConfig, world_size: int) -> None:
    """Every size against the world, as `ParallelDims` will check them at initialize: here
    already, so a config that cannot fit fails before any process group is built."""
    problems = size_problems(
        world_size,
        -1,  # shard groups are checked against the nodes at initialize (zerodp.comm.subgroups)
        parsed.sequence_parallel_size,
        parsed.tensor_parallel.size,
        parsed.expert_parallel.size,
    )
    if problems:
        raise ConfigError("; ".join(problems))


def _hints_for(hints: AutoHints | None, world_size: int) -> AutoHints:
    hints = hints or AutoHints()
    if hints.world_size is None:
        return dataclasses.replace(hints, world_size=world_size)
    if hints.world_size != world_size:
        raise ValueError(
            f"hints.world_size {hints.world_size} != world_size {world_size}; pass one world size"
        )
    return hints


def _parse(raw: dict[str, Any], hints: AutoHints, rank: int) -> ZeroDPConfig:
    """DeepSpeed compatibility, then "auto", then validation; one error for all problems."""
    translation = translate(copy.deepcopy(raw))
    notices = list(translation.notices) + _replaced_blocks(translation.data, hints)
    problems = list(translation.problems)
    try:
        data = resolve_auto(translation.data, hints)
    except ConfigError as exc:
        problems += str(exc).splitlines()
        data = {}
    if problems:
        raise ConfigError("\n".join(problems))
    parsed = ZeroDPConfig(**data)
    notices += _enabled_without_effect(parsed)
    if notices and rank == 0:
        warnings.warn(format_notice(notices), ConfigWarning, stacklevel=3)
    return parsed


def _enabled_without_effect(config: ZeroDPConfig) -> list[Notice]:
    """A dimension switched on at size 1 runs without it (as DeepSpeed's does): say so."""
    expert = config.expert_parallel
    if expert.enabled and expert.autoep_size == 1:
        return [
            Notice(
                "expert_parallel.autoep_size",
                "= 1 with enabled true: every rank holds every expert (no expert parallelism); "
                "set autoep_size to the ranks each layer's experts are split over",
                differs=True,
            )
        ]
    return []


def _replaced_blocks(data: Mapping[str, Any], hints: AutoHints) -> list[Notice]:
    """Config blocks the engine will not use, because initialize was given an instance."""
    out = []
    if hints.optimizer_given and "optimizer" in data:
        out.append(Notice("optimizer", "unused: the optimizer passed to initialize replaces it"))
    if hints.lr_scheduler_given and "scheduler" in data:
        out.append(Notice("scheduler", "unused: the lr_scheduler passed to initialize replaces it"))
    return out


def _as_dict(config: object) -> dict[str, Any]:
    if isinstance(config, str | os.PathLike):
        return _read_json(Path(config))
    if not isinstance(config, Mapping):
        raise ConfigError(
            f"config: got {show_value(config)} ({type(config).__name__}); allowed: a dict, "
            "a path to a JSON file, or a ZeroDPConfig; pass one of those"
        )
    bad = [k for k in config if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"config keys must be strings: got {bad[0]!r}; use the JSON key name")
    return dict(config)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file '{path}' does not exist; pass the path of an existing JSON file"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"cannot read config file '{path}': {exc}; pass a readable UTF-8 JSON file"
        ) from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file '{path}' is not valid JSON: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}; fix the JSON syntax there"
        ) from None
    except _DuplicateKeyError as exc:
        raise ConfigError(
            f"config file '{path}' sets key '{exc.key}' twice in the same object; "
            "keep only one of them"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}': got a JSON {type(data).__name__} at the top level; "
            "allowed: a JSON object; wrap the settings in {...}"
        )
    return data


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Reject repeated keys: json.loads would silently keep the last one."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out
