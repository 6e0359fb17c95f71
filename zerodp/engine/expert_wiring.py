"""Expert parallelism in the engine: the experts split before the layout.

`split_experts_for_engine` runs where `zerodp.engine.tensor_wiring` splits a
tensor-parallel model: after every rank took rank 0's whole model
(`zerodp.engine.model_sync`), before the flat groups are laid out. Each rank then
keeps E-th of every MoE layer's experts (`zerodp.expert_parallel.split_experts`);
to ZeRO those slices are ordinary parameters of their own flat groups
(`Slicing.EXPERT`), sharded, reduced and gathered over the expert-data group
(`GroupComms.shard_of`), their gradients divided as the dims say (rule 1 of
[Note: parallel dimensions]). Which modules are experts comes from the model's
own expert plan, or from the config: zerodp's `plan` patterns, or DeepSpeed's
`moe_layer_pattern` / `expert_pattern`. DeepSpeed's `preset_model` is checked
against the model's type.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zerodp.comm.subgroups import GroupComms
from zerodp.config import ZeroDPConfig
from zerodp.config.expert_parallel import PRESET_MODEL_TYPES, ExpertParallelConfig
from zerodp.errors import ConfigError
from zerodp.expert_parallel import ExpertSplit, split_experts


def split_experts_for_engine(
    module: nn.Module, config: ZeroDPConfig, comms: GroupComms
) -> ExpertSplit | None:
    """Split `module`'s experts over this rank's EP group (None: no expert parallelism).

    Every rank checks the same model, so a model that cannot be split is the same
    `ConfigError` on every rank (agreed through the world before anything changes).
    """
    dims = comms.dims
    if not dims.splits_experts:
        return None
    settings = config.expert_parallel
    error: ConfigError | None = None
    try:
        _check_preset(module, settings.preset_model)
        patterns = _patterns(module, settings)
    except ConfigError as caught:
        error, patterns = caught, None
    comms.world.raise_if_any_failed(error)
    group = comms.expert
    if group is None:  # pragma: no cover - made whenever E > 1
        raise RuntimeError("internal error: expert parallelism without its group")
    split: ExpertSplit | None = None
    try:
        split = split_experts(module, dims.expert_size, dims.expert_rank, group, patterns)
    except ConfigError as caught:
        error = caught
    comms.world.raise_if_any_failed(error)
    if split is None:  # pragma: no cover - raised above on every rank
        raise RuntimeError("internal error: no expert split")
    return split


def _patterns(module: nn.Module, settings: ExpertParallelConfig) -> list[str] | None:
    """The experts modules the config names (None: the model's own expert plan)."""
    if settings.plan is not None:
        return list(settings.plan)
    names = [name for name, _ in module.named_modules()]
    found = settings.experts_modules(names)
    if found is not None and not found:
        child = settings.expert_pattern or "experts"
        raise ConfigError(
            f"expert_parallel.moe_layer_pattern {settings.moe_layer_pattern!r} with "
            f"expert_pattern {child!r} names no module of {type(module).__name__}: give a "
            "regular expression that matches the MoE layers' full names (e.g. "
            r"'model\.layers\.\d+\.mlp') and the experts module's name inside them"
        )
    return found


def _check_preset(module: nn.Module, preset: str | None) -> None:
    """DeepSpeed's preset names a model family; zerodp reads the model's own plan instead,
    so the name is only checked: a preset of another family is a mistake worth naming."""
    if preset is None:
        return
    model_type = _model_type(module)
    covers = PRESET_MODEL_TYPES[preset]
    if model_type is not None and model_type not in covers:
        raise ConfigError(
            f"expert_parallel.preset_model {preset!r} is DeepSpeed's preset for "
            f"{', '.join(covers)} models, but this model is a {model_type!r} one: remove "
            "preset_model (zerodp splits the experts the model's own expert plan names), or "
            "give the preset of this model's family"
        )


def _model_type(module: nn.Module) -> Any:
    config = getattr(module, "config", None)
    return getattr(config, "model_type", None)
