"""The zerodp config of a Trainer run: the user's config, completed from the TrainingArguments.

People bring the DeepSpeed-style config they wrote for the HF Trainer, with
"auto" for everything the Trainer's arguments already say. The Trainer, not
the config, decides the batch size of its data loader, the accumulation
steps of its loop and the length of the run, so those keys must agree with
the arguments. The rules are HF's for DeepSpeed:

| config key | from TrainingArguments | when the key is absent |
|---|---|---|
| train_micro_batch_size_per_gpu | per_device_train_batch_size | filled |
| gradient_accumulation_steps | gradient_accumulation_steps | filled |
| train_batch_size | micro batch x accumulation steps x data ranks (world / (S x T)) | filled |
| gradient_clipping | max_grad_norm | filled |
| optimizer.params.lr / betas | learning_rate / [adam_beta1, adam_beta2] | left out |
| optimizer.params.eps / weight_decay | adam_epsilon / weight_decay | left out |
| scheduler.params.warmup_max_lr | learning_rate | left out |
| scheduler.params.warmup_min_lr | 0 ("auto" only) | left out |
| scheduler.params.warmup_num_steps | get_warmup_steps(total steps) ("auto" only) | left out |
| scheduler.params.total_num_steps | the run's optimizer steps ("auto" only) | left out |
| fp16.enabled / bf16.enabled | fp16 / bf16 | filled when true |

"auto" is replaced by the argument's value; an explicit value that disagrees
with the argument is an error (all of them in one `ConfigError`), because the
Trainer would silently do something else than the engine. Keys marked
"auto" only keep an explicit value. Every other "auto" (bucket sizes from the
hidden size, offload devices) is left to `zerodp.initialize`
(`zerodp.config.auto`). Without an "optimizer" block the Trainer's own
optimizer choice (`args.optim`) is used, without a "scheduler" block its
`lr_scheduler_type`: see `ZeroDPTrainer`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerodp.errors import ConfigError

AUTO = "auto"


@dataclass(frozen=True)
class TrainerValues:
    """What the TrainingArguments (and the run's length) say about the config keys above."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    max_grad_norm: float
    learning_rate: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    warmup_steps: int
    num_training_steps: int
    fp16: bool
    bf16: bool

    @classmethod
    def from_args(cls, args: Any, *, num_training_steps: int, world_size: int) -> TrainerValues:
        """Read a `transformers.TrainingArguments` (duck-typed: only these attributes)."""
        return cls(
            micro_batch_size=int(args.per_device_train_batch_size),
            gradient_accumulation_steps=int(args.gradient_accumulation_steps),
            world_size=world_size,
            max_grad_norm=float(args.max_grad_norm or 0.0),
            learning_rate=float(args.learning_rate),
            betas=(float(args.adam_beta1), float(args.adam_beta2)),
            eps=float(args.adam_epsilon),
            weight_decay=float(args.weight_decay),
            warmup_steps=int(args.get_warmup_steps(num_training_steps)),
            num_training_steps=int(num_training_steps),
            fp16=bool(args.fp16),
            bf16=bool(args.bf16),
        )


def read_config(config: Any) -> dict[str, Any]:
    """A copy of the user's config: a dict, or the path of a JSON file."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read zerodp_config '{path}': {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"zerodp_config '{path}' is not valid JSON: {exc.msg} at line {exc.lineno}"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"zerodp_config '{path}' must hold a JSON object")
        return data
    raise ConfigError(
        f"zerodp_config must be a dict or the path of a JSON file, got {type(config).__name__}"
    )


def trainer_config(config: Any, values: TrainerValues) -> dict[str, Any]:
    """The config to hand to `zerodp.initialize` for this Trainer run (see the module doc)."""
    data = read_config(config)
    mismatches: list[str] = []
    fill = ConfigFiller(data, mismatches)
    args = "TrainingArguments."
    global_batch = values.micro_batch_size * values.gradient_accumulation_steps * values.world_size
    fill.match(
        "train_micro_batch_size_per_gpu",
        values.micro_batch_size,
        args + "per_device_train_batch_size",
    )
    fill.match(
        "gradient_accumulation_steps",
        values.gradient_accumulation_steps,
        args + "gradient_accumulation_steps",
    )
    fill.match(
        "train_batch_size",
        global_batch,
        "per_device_train_batch_size x gradient_accumulation_steps x data-parallel ranks",
    )
    fill.match("gradient_clipping", values.max_grad_norm, args + "max_grad_norm")
    if isinstance(data.get("optimizer"), dict):
        optimizer_values = (
            ("lr", values.learning_rate, "learning_rate"),
            ("betas", list(values.betas), "[adam_beta1, adam_beta2]"),
            ("eps", values.eps, "adam_epsilon"),
            ("weight_decay", values.weight_decay, "weight_decay"),
        )
        for key, value, name in optimizer_values:
            fill.match(f"optimizer.params.{key}", value, args + name, absent=False)
    if isinstance(data.get("scheduler"), dict):
        fill.match(
            "scheduler.params.warmup_max_lr",
            values.learning_rate,
            args + "learning_rate",
            absent=False,
        )
        fill.fill_auto("scheduler.params.warmup_min_lr", 0.0)
        fill.fill_auto("scheduler.params.warmup_num_steps", values.warmup_steps)
        fill.fill_auto("scheduler.params.total_num_steps", values.num_training_steps)
    for section, enabled in (("fp16", values.fp16), ("bf16", values.bf16)):
        present = isinstance(data.get(section), dict) and "enabled" in data[section]
        if present or enabled:
            fill.match(f"{section}.enabled", enabled, args + section)
    if mismatches:
        raise mismatch_error("zerodp_config", "the TrainingArguments", mismatches)
    return data


class ConfigFiller:
    """Writes a training loop's values at dotted paths of a config dict; records disagreements.

    Shared by the Trainer and Lightning integrations: each mismatch is one line
    for the one `ConfigError` the caller raises.
    """

    def __init__(self, data: dict[str, Any], mismatches: list[str]) -> None:
        self.data = data
        self.mismatches = mismatches

    def match(self, path: str, value: Any, argument: str, *, absent: bool = True) -> None:
        """ "auto" -> value; absent -> value when `absent`; anything else must equal it."""
        parent, key = self._parent(path, create=absent)
        if parent is None:
            return
        if key not in parent:
            if absent:
                parent[key] = value
            return
        current = parent[key]
        if current == AUTO:
            parent[key] = value
        elif not _same(current, value):
            self.mismatches.append(
                f"- '{path}' is {json.dumps(current)}, but {argument} is {json.dumps(value)}"
            )

    def fill_auto(self, path: str, value: Any) -> None:
        """ "auto" -> value; an explicit value is kept."""
        parent, key = self._parent(path, create=False)
        if parent is not None and parent.get(key) == AUTO:
            parent[key] = value

    def _parent(self, path: str, *, create: bool) -> tuple[dict[str, Any] | None, str]:
        *sections, key = path.split(".")
        node = self.data
        for section in sections:
            child = node.get(section)
            if child is None and create:
                child = node[section] = {}
            if not isinstance(child, dict):
                return None, key
            node = child
        return node, key


def mismatch_error(config_name: str, source: str, mismatches: list[str]) -> ConfigError:
    return ConfigError(
        f"{config_name} disagrees with {source} (the loop would do one thing and the "
        f'engine another); set these keys to "auto" or to the value shown:\n'
        + "\n".join(mismatches)
    )


def _same(current: Any, value: Any) -> bool:
    if isinstance(value, bool) or isinstance(current, bool):
        return current is value or current == value
    if isinstance(value, list):
        return (
            isinstance(current, list | tuple)
            and len(current) == len(value)
            and all(_same(c, v) for c, v in zip(current, value, strict=True))
        )
    if isinstance(value, int | float) and isinstance(current, int | float):
        return float(current) == float(value)
    return bool(current == value)


def refuse_unsupported_arguments(args: Any) -> None:
    """TrainingArguments that would put another engine or wrapper around the model."""
    if args is None:
        return
    problems = []
    if getattr(args, "deepspeed", None):
        problems.append("deepspeed= (pass that config as ZeroDPTrainer(zerodp_config=...) instead)")
    if getattr(args, "fsdp", None):
        problems.append("fsdp= (zerodp shards the model itself)")
    if getattr(args, "auto_find_batch_size", False):
        problems.append("auto_find_batch_size=True (it rebuilds the model's engine mid-run)")
    if problems:
        raise ConfigError("ZeroDPTrainer cannot use TrainingArguments " + "; ".join(problems))
