"""A DeepSpeed ZeRO checkpoint as Hugging Face safetensors, and as a description of its model.

`export_safetensors` writes the full weights (the fp32 masters of trained
parameters, the saved weights of frozen ones, the buffers) in Hugging
Face's layout, without a process group and in bounded memory: shards are
planned from the shapes alone, and each shard's parameters are read from
DeepSpeed's memory-mapped files just before the shard is written, so at
most one shard (`max_shard_bytes`) is held at a time, plus the pages being
copied. Tied parameters are written once, under the name DeepSpeed saved
them by, as `save_pretrained` does.

`describe_run` says what model and optimizer a checkpoint is for (names,
shapes, dtype, tied names, param groups and their settings, the run's
config), which is what `zerodp convert` needs to rebuild an engine for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerodp.checkpoint_io.deepspeed.files import DeepSpeedFiles, find_checkpoint
from zerodp.checkpoint_io.deepspeed.records import ModelStates, read_model_states
from zerodp.checkpoint_io.deepspeed.sources import Wanted, frozen_value, module_value, open_source
from zerodp.checkpoint_io.safetensors_stream import (
    SafetensorsStreamWriter,
    TensorEntry,
    plan_files,
    write_index,
)
from zerodp.errors import CheckpointError

DEFAULT_SHARD_BYTES = 5 * 2**30  # Hugging Face's default for save_pretrained


def open_deepspeed(src: str | Path, tag: str | None) -> tuple[DeepSpeedFiles, ModelStates]:
    files = find_checkpoint(src, tag)
    if files is None:
        raise CheckpointError(
            f"'{src}'{f' (tag {tag})' if tag else ''} holds no DeepSpeed checkpoint: pass the "
            "directory DeepSpeed's save_checkpoint wrote (with its 'latest' file), or a "
            "global_stepN folder"
        )
    return files, read_model_states(files.model_files[0])


@dataclass(frozen=True)
class RunDescription:
    """The model and optimizer a DeepSpeed checkpoint was saved from, as far as it says."""

    files: DeepSpeedFiles
    model: ModelStates
    shapes: dict[str, tuple[int, ...]]  # every saved parameter, trained and frozen
    trainable: list[str]
    dtype: torch.dtype  # the training dtype of the saved weights
    buffers: dict[str, torch.Tensor]
    group_members: list[list[str]]
    group_settings: list[dict[str, Any]]  # lr, betas, eps, weight_decay of each param group
    # Every setting of each param group as the run's optimizer saved it (empty when the
    # checkpoint keeps none): a torch optimizer the run passed in saved its flags too.
    saved_group_settings: list[dict[str, Any]]


def describe_run(src: str | Path, tag: str | None) -> RunDescription:
    files, model = open_deepspeed(src, tag)
    source = open_source(files, model)
    optimizer = source.optimizer
    dtypes = {v.dtype for k, v in model.module.items() if k not in model.buffer_names}
    floating = [d for d in dtypes if d.is_floating_point]
    groups = optimizer.param_groups or [{} for _ in optimizer.group_members]
    settings = [
        {k: v for k, v in group.items() if k in ("lr", "betas", "eps", "weight_decay")}
        for group in groups
    ]
    return RunDescription(
        files=files,
        model=model,
        shapes={**model.trainable_shapes, **model.frozen_shapes},
        trainable=list(model.trainable_shapes),
        dtype=floating[0] if len(floating) == 1 else torch.float32,
        buffers={name: model.module[name] for name in model.buffer_names if name in model.module},
        group_members=optimizer.group_members,
        group_settings=settings,
        saved_group_settings=[{k: v for k, v in g.items() if k != "params"} for g in groups],
    )


def export_safetensors(
    src: str | Path,
    out_dir: str | Path,
    *,
    tag: str | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Write the checkpoint's full weights to `out_dir` as (sharded) safetensors; returns the files.

    Floating weights are written in `dtype` (the fp32 masters by default).
    """
    run = describe_run(src, tag)
    source = open_source(run.files, run.model)
    models = [run.model] + [read_model_states(p) for p in run.files.model_files[1:]]
    names = [*run.shapes, *run.buffers]

    def out_dtype(name: str) -> torch.dtype:
        saved = run.buffers[name].dtype if name in run.buffers else dtype
        return dtype if saved.is_floating_point else saved

    entries = [
        TensorEntry(
            n, out_dtype(n), run.shapes[n] if n in run.shapes else tuple(run.buffers[n].shape)
        )
        for n in names
    ]
    out = Path(out_dir)
    files = plan_files(out, entries, max_shard_bytes)
    trained = set(run.trainable)
    for file, file_entries in files:
        wanted = {
            e.name: Wanted(e.name, 0, _numel(e.shape), {"fp32": torch.empty(_numel(e.shape))})
            for e in file_entries
            if e.name in trained
        }
        source.fill(list(wanted.values()))
        with SafetensorsStreamWriter(file, file_entries, {"format": "pt"}) as writer:
            for entry in file_entries:
                if entry.name in wanted:
                    value = wanted.pop(entry.name).destinations["fp32"]
                elif entry.name in run.buffers:
                    value = run.buffers[entry.name]
                else:
                    saved = module_value(run.model, entry.name)
                    value = (
                        saved
                        if saved is not None
                        else frozen_value(models, entry.name, entry.shape)
                    )
                writer.write(entry.name, value.reshape(entry.shape).to(entry.dtype))
    write_index(out, files)
    return [file for file, _ in files]


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())
