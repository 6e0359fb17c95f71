"""DeepSpeed's activation checkpointing API (`deepspeed.checkpointing`), for Megatron-style code.

`checkpoint(function, *args)` runs `function` without keeping its activations
and runs it again in backward: torch's non-reentrant checkpoint, with the
default generator and every state of the RNG tracker (`rng`) restored for the
recomputation, so dropout draws the same masks both times. It is exact under
zerodp at every stage: the recomputation is an ordinary forward inside the
backward graph task, whose gathers stage 3 serves as any other ([Note:
backward lifecycle]), and parameters receive their gradients even when no
input requires grad (where DeepSpeed's reentrant version gives them none).

`configure()` takes DeepSpeed's arguments. Its settings change how DeepSpeed
stores checkpointed activations (partitioned over a model-parallel group, in
one buffer, on the CPU) or time them, never what is computed; zerodp has no
model-parallel group and keeps activations where they are, so a setting that
asks for any of that is accepted with one warning saying it has no effect.
A model-parallel `mpu` of more than one rank is refused.

A face over the package: nothing in zerodp imports it.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from zerodp.checkpointing.rng import (
    MODEL_PARALLEL_RNG,
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from zerodp.errors import ConfigWarning, UsageError

__all__ = [
    "MODEL_PARALLEL_RNG",
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
]

# DeepSpeed's `activation_checkpointing` config keys -> configure()'s argument names.
_CONFIG_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "number_checkpoints": "num_checkpoints",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}
_NO_EFFECT = {
    "partition_activations": "there is no model-parallel group to partition activations over",
    "contiguous_checkpointing": "checkpointed inputs stay in their own tensors",
    "checkpoint_in_cpu": "checkpointed inputs stay on the device",
    "synchronize": "no device synchronisation is added around checkpoints",
    "profile": "checkpoints are not timed",
}


class _Settings:
    configured = False
    num_checkpoints: int | None = None


def configure(
    mpu_: Any = None,
    deepspeed_config: str | Path | dict[str, Any] | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's `configure`: the config file's `activation_checkpointing` block, then the
    arguments given (see the module docstring for what they do here)."""
    _check_mpu(mpu_)
    settings: dict[str, Any] = {}
    if deepspeed_config is not None:
        settings.update(_from_config(deepspeed_config))
    given = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    settings.update({k: v for k, v in given.items() if v is not None})
    if settings.get("contiguous_checkpointing") and not settings.get("partition_activations"):
        raise UsageError(
            "activation checkpointing: contiguous_memory_optimization needs "
            "partition_activations (as in DeepSpeed); set both or neither"
        )
    _warn_no_effect([k for k in _NO_EFFECT if settings.get(k)])
    _Settings.num_checkpoints = settings.get("num_checkpoints")
    _Settings.configured = True


def _check_mpu(mpu: Any) -> None:
    if mpu is None:
        return
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        size = getattr(mpu, name, None)
        if size is not None and size() > 1:
            raise UsageError(
                f"activation checkpointing: the mpu has {size()} model-parallel ranks; zerodp "
                "reads no Megatron mpu (its tensor parallelism is set in the config and keeps "
                "its groups inside the engine); configure without an mpu"
            )


def _from_config(config: str | Path | dict[str, Any]) -> dict[str, Any]:
    data = config if isinstance(config, dict) else json.loads(Path(config).read_text())
    block = data.get("activation_checkpointing", {})
    if not isinstance(block, dict):
        raise UsageError("config key 'activation_checkpointing': allowed: a JSON object")
    unknown = sorted(set(block) - set(_CONFIG_KEYS))
    if unknown:
        raise UsageError(
            f"config keys {['activation_checkpointing.' + k for k in unknown]} are unknown; "
            f"allowed: {sorted(_CONFIG_KEYS)}"
        )
    return {_CONFIG_KEYS[key]: value for key, value in block.items()}


def _warn_no_effect(names: list[str]) -> None:
    if names:
        reasons = "; ".join(f"{name}: {_NO_EFFECT[name]}" for name in names)
        warnings.warn(
            f"activation checkpointing settings with no effect in zerodp ({reasons}); "
            "what is computed is the same",
            ConfigWarning,
            stacklevel=3,
        )


def is_configured() -> bool:
    """Whether `configure()` was called (DeepSpeed's; `checkpoint` works either way)."""
    return _Settings.configured


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` recomputed in backward instead of kept (module docstring).

    Returns what DeepSpeed's does: a single tensor as itself, several outputs as a tuple.
    """
    outputs = torch_checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=_tracker_contexts,
        **kwargs,
    )
    if isinstance(outputs, torch.Tensor) or not isinstance(outputs, (tuple, list)):
        return outputs
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


non_reentrant_checkpoint = checkpoint


def _tracker_contexts() -> tuple[contextlib.AbstractContextManager[None], Any]:
    """(the forward's context: nothing; the recomputation's: the tracker as it was)."""
    return contextlib.nullcontext(), _tracker_as(get_cuda_rng_tracker().get_states())


@contextlib.contextmanager
def _tracker_as(states: dict[str, torch.Tensor]) -> Iterator[None]:
    tracker = get_cuda_rng_tracker()
    current = tracker.get_states()
    tracker.set_states(states)
    try:
        yield
    finally:
        tracker.set_states(current)


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's switch; it has no effect here (no model-parallel group)."""
    if partition_activation:
        _warn_no_effect(["partition_activations"])


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's buffer sizing for contiguous checkpoints; kept, and unused."""
    _Settings.num_checkpoints = nlayers


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; zerodp keeps none, so nothing to do."""
