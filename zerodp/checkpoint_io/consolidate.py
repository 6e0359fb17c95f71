"""One full fp32 state dict from a sharded checkpoint, with no process group.

The result loads into the plain model with `load_state_dict(strict=True)`:
every key of the model's state dict is present, tied parameters under each
of their names, values in fp32 (from the fp32 master weights when the run
used mixed precision), tensor-parallel slices joined into whole tensors.
Written as safetensors when the output ends in `.safetensors` (and
safetensors is installed), else with `torch.save`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from zerodp.checkpoint_io import checksums, integrity, json_state, schema, tensor_slices
from zerodp.checkpoint_io.destinations import check_kinds
from zerodp.checkpoint_io.paths import check_load_source
from zerodp.checkpoint_io.safe_metadata import METADATA_FILE, SafeReader
from zerodp.checkpoint_io.sharded import quiet_sharded_tensor_warnings
from zerodp.errors import CheckpointError, ZeroDPError


def full_state_dict_from_checkpoint(
    checkpoint_dir: str | Path, tag: str | None = None, verify_checksums: bool = True
) -> dict[str, torch.Tensor]:
    """Every file is checked (checksums, metadata read without unpickling) before any read;
    every failure is a `CheckpointError` naming the file."""
    try:
        return _full_state_dict(checkpoint_dir, tag, verify_checksums)
    except (ZeroDPError, ValueError, OSError):
        raise
    except integrity.CHECKPOINT_FAILURES as error:
        raise CheckpointError(f"reading checkpoint '{checkpoint_dir}' failed: {error}") from error


def _full_state_dict(
    checkpoint_dir: str | Path, tag: str | None, verify_checksums: bool
) -> dict[str, torch.Tensor]:
    path, _ = check_load_source(checkpoint_dir, tag)
    manifest = checksums.read_manifest(path) if verify_checksums else None
    if manifest is not None:
        for name in (METADATA_FILE, json_state.STATE_FILE):
            checksums.check_small_file(path, name, manifest)
    shared = json_state.read_shared_state(path)
    schema.check_shared_state(shared)
    metadata = integrity.read_metadata(path)
    integrity.check_files(path, metadata)
    if manifest is not None:
        chunks = checksums.chunks_by_file(metadata)
        for name in sorted(chunks):
            checksums.check_data_file(path, name, chunks[name], manifest)
    saved = integrity.saved_keys(metadata)
    slices_of = tensor_slices.saved_size(shared)
    split_dims = shared[tensor_slices.KEY]["slices"] if slices_of > 1 else {}
    wanted: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, info in shared["params"].items():
        source = f"master.{name}" if f"master.{name}" in saved else f"model.{name}"
        numel = int(torch.Size(info["shape"]).numel()) * (slices_of if name in split_dims else 1)
        wanted[source] = torch.empty(numel, dtype=torch.float32)
        sources[name] = source
    for name in shared["buffers"]:
        key = f"buffer.{name}"
        if key in saved:
            wanted[key] = torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
    check_kinds(wanted, saved, metadata)
    with quiet_sharded_tensor_warnings(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*load in a single process.*")
        dcp.load(wanted, storage_reader=SafeReader(path, metadata), no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for key in shared["state_dict_keys"]:
        name = shared["tied"].get(key, key)
        if name in sources:
            shape = shared["params"][name]["shape"]
            value = wanted[sources[name]]
            if name in split_dims:
                out[key] = tensor_slices.join_slices(value, shape, split_dims[name], slices_of)
            else:
                out[key] = value.view(shape)
        elif f"buffer.{key}" in wanted:
            out[key] = wanted[f"buffer.{key}"]
    return out


def consolidate_checkpoint(
    checkpoint_dir: str, output_path: str, tag: str | None = None, verify_checksums: bool = True
) -> Path:
    """Write the full fp32 state dict of a checkpoint to `output_path`; returns the path."""
    state = full_state_dict_from_checkpoint(checkpoint_dir, tag, verify_checksums)
    output = Path(output_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as error:
            raise ImportError(
                "writing .safetensors needs the safetensors package (pip install safetensors); "
                "or give an output path ending in .pt"
            ) from error
        # safetensors refuses tensors that share memory (tied weights): store copies.
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(output))
    else:
        torch.save(state, output)
    return output
