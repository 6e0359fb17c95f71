"""`zerodp convert deepspeed SRC DST [--hf DIR]`: a DeepSpeed checkpoint as a zerodp one, once.

The zerodp checkpoint is written by a one-process engine on a stand-in
model: a module tree with DeepSpeed's parameter names and shapes (tied
names share one parameter, as `shared_params` says), its buffers, and the
run's optimizer (DeepSpeed's param groups with their saved settings) and
scheduler (the run's config). That engine loads the DeepSpeed checkpoint
through `engine.load_checkpoint` (the same code a training run uses) and
saves it; the result loads into the real model at any stage and world size,
since zerodp's checkpoints are keyed by parameter name. It holds the whole
training state in memory (16 bytes per trainable parameter: the weights, a
gradient buffer, and the fp32 masters and Adam moments, 12 of the 16 under
bf16 or fp16); for a model too large for that, load the DeepSpeed checkpoint
directly with `engine.load_checkpoint`, which reads only each rank's part.

`--hf DIR` also writes the full weights as Hugging Face safetensors, in
bounded memory (see `zerodp.checkpoint_io.deepspeed.export`).

Loading the result gives what loading the DeepSpeed checkpoint directly
gives: the client_state the run saved, the counters (micro-steps counted with
the run's gradient_accumulation_steps, as a direct load into an engine with
the run's gas counts them), the LR scheduler's state as DeepSpeed saved it
(`SavedScheduler`: also a torch scheduler the run passed in itself), the loss
scaler, the optimizer state and settings,
frozen parameters and buffers. DeepSpeed saves no random generator states, so
the zerodp checkpoint keeps none either, and a load leaves the generators as
they are (as a direct load does) instead of taking the converting process's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerodp.checkpoint_io.deepspeed.export import RunDescription, describe_run, export_safetensors

# The scheduler is not rebuilt from the config: its saved state is carried (`SavedScheduler`).
_CONFIG_BLOCKS = ("optimizer", "gradient_clipping", "fp16", "bf16")


class StandIn(nn.Module):
    """A module whose parameters and buffers have the saved names (it has no forward)."""


def stand_in(run: RunDescription) -> nn.Module:
    root = StandIn()
    for name, shape in run.shapes.items():
        owner, leaf = _owner(root, name)
        param = nn.Parameter(torch.zeros(shape, dtype=run.dtype), requires_grad=False)
        param.requires_grad_(name in run.trainable)
        owner.register_parameter(leaf, param)
    for alias, source in run.model.shared_params.items():
        owner, leaf = _owner(root, alias)
        owner.register_parameter(leaf, root.get_parameter(source))
    for name, value in run.buffers.items():
        owner, leaf = _owner(root, name)
        owner.register_buffer(leaf, torch.zeros_like(value, device="cpu"))
    return root


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = StandIn()
            module.add_module(part, child)
        module = child
    return module, leaf


class SavedScheduler:
    """The run's LR scheduler, as its saved state only: DeepSpeed's `{"last_batch_iteration":
    t}` for a schedule its config names, torch's state dict for one the run passed in. The
    zerodp checkpoint keeps it as saved, so that the scheduler of the engine that loads it
    (built as the run built its own) takes it as a direct load would: a schedule rebuilt
    here would take the stand-in's lrs, the saved (decayed) ones, as its peak. The stand-in
    engine never steps."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    @property
    def last_batch_iteration(self) -> Any:
        """DeepSpeed's step count, when the saved state is a DeepSpeed schedule's."""
        return self._state.get("last_batch_iteration")

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = state

    def step(self) -> None:
        raise RuntimeError("internal error: the conversion's engine steps nothing")


def _scheduler(run: RunDescription) -> Any:
    """A `SavedScheduler` holding the run's saved scheduler state (None: it had none)."""
    saved = run.model.lr_scheduler
    if not isinstance(saved, dict):
        return None
    return lambda optimizer: SavedScheduler(saved)


def _group_settings(run: RunDescription) -> list[dict[str, Any]]:
    """Each param group's settings for the stand-in's optimizer: the run's hyperparameters;
    all its settings when it passed its own torch optimizer (its config names none), so
    that the checkpoint keeps that optimizer's flags (fused, foreach, ...), not the ones
    zerodp would pick for a config optimizer."""
    if "optimizer" in run.model.ds_config or not any(run.saved_group_settings):
        return run.group_settings
    return [dict(settings) for settings in run.saved_group_settings]


def _config(run: RunDescription) -> dict[str, Any]:
    saved = run.model.ds_config
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
    config.update({k: copy.deepcopy(saved[k]) for k in _CONFIG_BLOCKS if k in saved})
    gas = saved.get("gradient_accumulation_steps")
    if isinstance(gas, int) and not isinstance(gas, bool) and gas > 1:
        config["gradient_accumulation_steps"] = gas  # micro-steps counted as the run did
    if "optimizer" not in config:  # the run passed its own optimizer: Adam with its settings
        config["optimizer"] = {"type": "AdamW", "params": {}}
    if run.dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    elif run.dtype == torch.float16:
        config.setdefault("fp16", {"enabled": True})
    config["zero_optimization"] = {"stage": 0}
    return config


def convert_deepspeed(
    src: str,
    dst: str,
    *,
    tag: str | None = None,
    hf_dir: str | None = None,
    hf_dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
) -> tuple[str, list[Path]]:
    """Write the zerodp checkpoint under `dst` (and safetensors under `hf_dir`); returns
    (the zerodp checkpoint's path, the safetensors files)."""
    import zerodp

    run = describe_run(src, tag)
    module = stand_in(run)
    by_name = dict(module.named_parameters())
    groups = [
        {"params": [by_name[n] for n in members], **settings}
        for members, settings in zip(run.group_members, _group_settings(run), strict=True)
    ]
    engine, *_ = zerodp.initialize(
        model=module, model_parameters=groups, config=_config(run), lr_scheduler=_scheduler(run)
    )
    try:
        _, client_state = engine.load_checkpoint(
            str(run.files.folder.parent), tag=run.files.folder.name
        )
        path = engine.save_checkpoint(
            dst, tag=run.files.folder.name, client_state=client_state, random_states=False
        )
    finally:
        engine.destroy()
    written: list[Path] = []
    if hf_dir is not None:
        kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
        written = export_safetensors(src, hf_dir, tag=tag, dtype=hf_dtype, **kwargs)
    return path, written
