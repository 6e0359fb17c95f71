"""DeepSpeed's checkpoint dicts, read into typed records that say what each value means.

Every value is checked as it is taken (`_field`), so a file that does not
have the structure DeepSpeed 0.x writes is a `CheckpointError` naming the
file and the key, before anything is loaded. The keys are DeepSpeed's; see
docs/deepspeed.md for what is read from which file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerodp.checkpoint_io.deepspeed.unpickle import DeepSpeedRecord, read_pickle
from zerodp.errors import CheckpointError

# Keys of a model-states file that DeepSpeed writes itself; the rest is the user's client_state.
DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        "universal_checkpoint_info",
    }
)


def _field(data: Mapping[str, Any], key: str, kind: Any, path: Path, default: Any = ...) -> Any:
    """`data[key]`, which must be a `kind`; `default` when it is absent or None (if given)."""
    if data.get(key) is None:
        if default is not ...:
            return default
        raise CheckpointError(
            f"'{path}' has no '{key}'; it was not written by DeepSpeed's save_checkpoint, or "
            "by a version whose layout zerodp does not know"
        )
    value = data[key]
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise CheckpointError(
            f"'{path}': '{key}' is a {type(value).__name__}, not what DeepSpeed writes there; "
            "the file is damaged or from an unknown DeepSpeed version"
        )
    return value


def _shape(value: Any, where: str, path: Path) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise CheckpointError(f"'{path}': the shape of '{where}' is {value!r}, not a shape")
    return tuple(int(v) for v in value)


def _shapes(value: Any, where: str, path: Path) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise CheckpointError(f"'{path}': '{where}' is not a map from parameter names to shapes")
    return {name: _shape(shape, f"{where}.{name}", path) for name, shape in value.items()}


@dataclass(frozen=True)
class ModelStates:
    """A model-states file: parameter order and shapes, module tensors, counters, client state.

    `flat_groups` lists, per DeepSpeed flat group (a param group at stages
    1-2, a sub-group at stage 3), its trainable parameters in flat order.
    """

    path: Path
    flat_groups: list[dict[str, tuple[int, ...]]]
    frozen_shapes: dict[str, tuple[int, ...]]
    buffer_names: list[str]
    shared_params: dict[str, str]  # a tied parameter's other name -> the name it is saved under
    module: dict[str, torch.Tensor]
    frozen_fragments: dict[str, torch.Tensor]
    global_steps: int
    global_samples: int | None
    skipped_steps: int
    lr_scheduler: Any
    data_sampler: Any
    dp_world_size: int
    ds_config: dict[str, Any]
    ds_version: str
    client_state: dict[str, Any] = field(default_factory=dict)

    @property
    def trainable_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for group in self.flat_groups for name, shape in group.items()}


def read_model_states(path: Path) -> ModelStates:
    data = read_pickle(path)
    if not isinstance(data, dict):
        raise CheckpointError(f"'{path}' holds a {type(data).__name__}, not DeepSpeed's dict")
    groups = _field(data, "param_shapes", list, path)
    module = _field(data, "module", Mapping, path, {}) or {}
    module_tensors = {k: v for k, v in module.items() if isinstance(v, torch.Tensor)}
    shared = _field(data, "shared_params", Mapping, path, {}) or {}
    config = _field(data, "ds_config", Mapping, path, {}) or {}
    flat_groups = [_shapes(g, f"param_shapes[{i}]", path) for i, g in enumerate(groups)]
    buffer_names = [str(n) for n in _field(data, "buffer_names", list, path, [])]
    frozen = _field(data, "frozen_param_shapes", Mapping, path, None)
    if frozen is None:  # stage 1 lists no frozen parameters: they are the module's other tensors
        known = {n for group in flat_groups for n in group} | set(buffer_names) | set(shared)
        frozen = {k: tuple(v.shape) for k, v in module_tensors.items() if k not in known}
    return ModelStates(
        path=path,
        flat_groups=flat_groups,
        frozen_shapes=_shapes(frozen, "frozen_param_shapes", path),
        buffer_names=buffer_names,
        shared_params={str(k): str(v) for k, v in shared.items()},
        module=module_tensors,
        frozen_fragments={
            str(k): v
            for k, v in (_field(data, "frozen_param_fragments", Mapping, path, {}) or {}).items()
            if isinstance(v, torch.Tensor)
        },
        global_steps=_field(data, "global_steps", int, path),
        global_samples=_field(data, "global_samples", int, path, None),
        skipped_steps=_field(data, "skipped_steps", int, path, 0),
        lr_scheduler=data.get("lr_scheduler"),
        data_sampler=data.get("data_sampler"),
        dp_world_size=_field(data, "dp_world_size", int, path),
        ds_config=dict(config),
        ds_version=str(data.get("ds_version", "unknown")),
        client_state={k: v for k, v in data.items() if k not in DEEPSPEED_KEYS},
    )


@dataclass(frozen=True)
class OptimizerStates:
    """One rank's ZeRO optimizer file.

    `partitions[g]` is this rank's fp32 master partition of flat group `g`;
    `states[g]` the torch optimizer's state for it (Adam: `exp_avg`,
    `exp_avg_sq`, `step`). `usable[g]` is how many leading elements of the
    partition hold parameters (the rest is alignment padding).
    `param_groups` are the torch optimizer's groups: hyperparameters and,
    under 'params', the flat groups each one holds.
    """

    path: Path
    stage: int
    partitions: list[torch.Tensor]
    states: list[dict[str, Any]]
    usable: list[int]
    param_groups: list[dict[str, Any]] | None
    loss_scaler: DeepSpeedRecord | None
    alignment_paddings: list[list[int]] | None
    partition_numels: list[int]


def read_optimizer_states(path: Path) -> OptimizerStates:
    data = read_pickle(path)
    if not isinstance(data, dict):
        raise CheckpointError(f"'{path}' holds a {type(data).__name__}, not DeepSpeed's dict")
    states = _field(data, "optimizer_state_dict", dict, path)
    if "fp32_flat_groups" in states:
        return _stage3(path, states)
    return _stage12(path, states)


def _tensors(value: Any, where: str, path: Path) -> list[torch.Tensor]:
    if not isinstance(value, list) or not all(
        isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point() for t in value
    ):
        raise CheckpointError(f"'{path}': '{where}' is not a list of flat float tensors")
    return value


def _torch_state(base: Any, count: int, path: Path) -> tuple[list[dict], list[dict] | None]:
    """(per flat group state, param groups) of a torch optimizer state dict (or an elastic list)."""
    if isinstance(base, list):  # elastic_checkpoint: one lean state per group, no param groups
        if len(base) != count or not all(isinstance(s, dict) for s in base):
            raise CheckpointError(f"'{path}': the elastic optimizer state has the wrong length")
        return base, None
    if not isinstance(base, dict):
        raise CheckpointError(f"'{path}': the base optimizer state is not a dict")
    state = _field(base, "state", dict, path)
    groups = _field(base, "param_groups", list, path)
    if sorted(state) != list(range(count)) or not all(isinstance(state[i], dict) for i in state):
        raise CheckpointError(
            f"'{path}': the optimizer state covers {sorted(state)}, not flat groups 0..{count - 1}"
            " (an optimizer zerodp cannot map, or a damaged file)"
        )
    return [state[i] for i in range(count)], groups


def _stage12(path: Path, data: dict[str, Any]) -> OptimizerStates:
    partitions = _tensors(
        _field(data, "single_partition_of_fp32_groups", list, path),
        "single_partition_of_fp32_groups",
        path,
    )
    count = len(partitions)
    paddings = _field(data, "group_paddings", list, path)
    if len(paddings) != count or not all(isinstance(p, int) and p >= 0 for p in paddings):
        raise CheckpointError(f"'{path}': 'group_paddings' does not match the fp32 partitions")
    states, groups = _torch_state(
        _field(data, "base_optimizer_state", (dict, list), path), count, path
    )
    # DeepSpeed's ZeRO optimizer saves the fp32 partitions without their padding (it records
    # its stage); the bf16 optimizer of stage 1 saves them padded.
    lean = "zero_stage" in data
    usable = [len(t) if lean else len(t) - pad for t, pad in zip(partitions, paddings, strict=True)]
    stage = int(data.get("zero_stage", 1))
    alignment = data.get("param_alignment_paddings")
    return OptimizerStates(
        path=path,
        stage=stage,
        partitions=partitions,
        states=states,
        usable=usable,
        param_groups=groups,
        loss_scaler=_scaler(data, path),
        alignment_paddings=alignment if isinstance(alignment, list) else None,
        partition_numels=[u + pad for u, pad in zip(usable, paddings, strict=True)],
    )


def _stage3(path: Path, data: dict[str, Any]) -> OptimizerStates:
    partitions = _tensors(_field(data, "fp32_flat_groups", list, path), "fp32_flat_groups", path)
    states, groups = _torch_state(
        _field(data, "optimizer_state_dict", dict, path), len(partitions), path
    )
    return OptimizerStates(
        path=path,
        stage=3,
        partitions=partitions,
        states=states,
        usable=[len(t) for t in partitions],
        param_groups=groups,
        loss_scaler=_scaler(data, path),
        alignment_paddings=None,
        partition_numels=[len(t) for t in partitions],
    )


def _scaler(data: dict[str, Any], path: Path) -> DeepSpeedRecord | None:
    scaler = data.get("loss_scaler")
    if scaler is not None and not isinstance(scaler, DeepSpeedRecord):
        raise CheckpointError(f"'{path}': 'loss_scaler' is not one of DeepSpeed's loss scalers")
    return scaler


def step_of(state: Mapping[str, Any], where: str) -> int:
    """The Adam step count of one flat group's state (an int or a 0-d tensor in DeepSpeed)."""
    step = state.get("step")
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{where}: the optimizer step count is {step!r}, not a count")
    return step
