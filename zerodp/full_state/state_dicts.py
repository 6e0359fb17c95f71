"""Full state dicts in and out of a model whose parameters zerodp may shard.

- `full_state_dict` gathers group by group (a collective at stage 3), so at
  most one group is gathered beyond what is gathered anyway;
- `save_state_dict` writes the model's weights as safetensors (Hugging Face's
  file names and index), streamed: groups are gathered one at a time and each
  tensor is appended to its file as it arrives, so no rank ever holds the
  whole model;
- `load_state_dict` writes a full state dict into the model one tensor at a
  time: every rank reads the tensor (from a dict, a safetensors or torch file,
  or a Hugging Face model directory with its index) and keeps only its part of
  it, so no rank ever holds more than the model's shards and one tensor. It
  needs no communication, and works on a model managed by an engine (the
  fp32 optimizer copies follow) and on one built under `zero.Init`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from zerodp.checkpoint_io.safetensors_stream import (
    SafetensorsStreamWriter,
    TensorEntry,
    plan_files,
    write_index,
)
from zerodp.comm import Comm, current_rank, is_initialized
from zerodp.errors import CheckpointError
from zerodp.full_state.gathered_parameters import GatheredParameters
from zerodp.full_state.param_managers import manager_of, manager_of_module
from zerodp.group_state import GroupState
from zerodp.partition.slicing import SliceRecord, local_part, whole_shape, whole_value
from zerodp.stage3 import zero_parameter


def full_state_dict(
    module: nn.Module, rank0_only: bool = False, device: str | torch.device = "cpu"
) -> dict[str, Any]:
    """The module's full state dict, gathered group by group (a collective at stage 3).

    With `rank0_only`, ranks other than 0 gather (they must take part) but
    return an empty dict, so only rank 0 holds the full copy in memory. Tied
    parameters are one tensor under each of their names (as in `module.state_dict()`),
    so `save_pretrained` writes them once.
    """
    manager = manager_of_module(module)
    keep = not rank0_only or manager is None or manager.global_rank == 0
    # With tensor parallelism every rank takes part in gathering the slices whole.
    split = _split_of(manager)
    values: dict[int, torch.Tensor] = {}
    done: set[int] = set()  # tensors gathered already (kept in `values` on ranks that keep)
    if manager is not None:
        for state in manager.params.sharded_states:
            with GatheredParameters(state.params):
                for param in state.params:
                    value = _whole(split, param, param.detach())
                    done.add(id(param))
                    if keep:
                        values[id(param)] = value.to(device).clone()
    if not keep and split is None:
        return {}
    result: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            result[key] = value
            continue
        if id(value) not in done:  # a tied tensor is one tensor under each of its names
            whole = _whole(split, value, value.detach())
            done.add(id(value))
            if keep:
                values[id(value)] = whole.to(device).clone()
        if keep:
            result[key] = values[id(value)]
    return result if keep else {}


def _split_of(manager: Any) -> list[SliceRecord] | None:
    """The records of the manager's tensor- and expert-parallel slices (None: neither)."""
    if manager is None:
        return None
    tensor = getattr(manager, "tensor_parallel", None)
    records: list[SliceRecord] = [] if tensor is None else [tensor.split]
    experts = getattr(manager, "expert_parallel", None)
    if experts is not None:
        records.append(experts)
    return records or None


def _whole_shape(split: list[SliceRecord] | None, tensor: torch.Tensor) -> tuple[int, ...]:
    return whole_shape(split or [], tensor, tuple(tensor.shape))


def _whole(split: list[SliceRecord] | None, param: Any, local: torch.Tensor) -> torch.Tensor:
    """`local`, or the whole tensor of which it is this rank's tensor- or expert-parallel
    slice (a collective over that slice's group)."""
    return local if split is None else whole_value(split, param, local)


# -- saving, streamed ----------------------------------------------------------------------


def save_state_dict(
    module: nn.Module,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    exclude_frozen: bool = False,
) -> list[Path]:
    """Write `module`'s weights as safetensors, streamed group by group (a collective).

    `path` ending in `.safetensors` is one file; any other path is a directory
    that gets Hugging Face's layout (`model.safetensors`, or
    `model-0000k-of-0000n.safetensors` files of at most `max_shard_bytes` and
    `model.safetensors.index.json`). Tied parameters are written once, under
    their first name, as `save_pretrained` does. Floating tensors are cast to
    `dtype` when given. Rank 0 writes; returns the files it wrote (every rank).
    """
    writes = _rank() == 0
    split = _split_of(manager_of_module(module))  # slices are written whole
    frozen = (
        {id(p) for p in module.parameters() if not p.requires_grad} if exclude_frozen else set()
    )
    seen: set[int] = set()
    targets: list[tuple[str, torch.Tensor]] = []
    for key, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen and id(tensor) not in frozen:
            seen.add(id(tensor))
            targets.append((key, tensor))

    def out_dtype(tensor: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype

    entries = [TensorEntry(k, out_dtype(t), _whole_shape(split, t)) for k, t in targets]
    files = plan_files(Path(path), entries, max_shard_bytes)
    position = 0
    held: GatheredParameters | None = None
    held_state: GroupState | None = None
    try:
        for file, file_entries in files:
            writer = SafetensorsStreamWriter(file, file_entries) if writes else None
            with writer if writer is not None else contextlib.nullcontext():
                for entry in file_entries:
                    key, tensor = targets[position]
                    position += 1
                    found = _group_of(tensor) if isinstance(tensor, nn.Parameter) else None
                    state = found[0] if found is not None and found[0].gather is not None else None
                    if state is not held_state:
                        if held is not None:
                            done, held = held, None
                            done.__exit__(None, None, None)
                        held_state = state
                        if state is not None:
                            held = GatheredParameters(state.params)
                            held.__enter__()
                    value = _whole(split, tensor, tensor.detach())  # every rank: a collective
                    if writer is not None:
                        writer.write(key, value.to(entry.dtype))
    finally:
        if held is not None:
            done, held = held, None
            done.__exit__(None, None, None)
    if writes:
        write_index(Path(path), files)
    if is_initialized():
        Comm().barrier()  # the files are complete when any rank returns
    return [f for f, _ in files]


def _rank() -> int:
    return current_rank() if is_initialized() else 0


# -- loading -------------------------------------------------------------------------------


class TensorSource(Protocol):
    """Named tensors, read one at a time."""

    def keys(self) -> list[str]: ...

    def get(self, key: str) -> torch.Tensor: ...


class _DictSource:
    def __init__(self, tensors: dict[str, Any]) -> None:
        self._tensors = tensors

    def keys(self) -> list[str]:
        return [k for k, v in self._tensors.items() if isinstance(v, torch.Tensor)]

    def get(self, key: str) -> torch.Tensor:
        tensor: torch.Tensor = self._tensors[key]
        return tensor


class _FileSource:
    """safetensors files read lazily; torch files memory-mapped (never unpickling code)."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, Path] = {}
        self._torch_files: dict[Path, dict[str, torch.Tensor]] = {}
        for file in files:
            for key in self._keys_of(file):
                self._where[key] = file

    def _keys_of(self, file: Path) -> list[str]:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as handle:
                return list(handle.keys())
        loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"'{file}' does not hold a state dict")
        self._torch_files[file] = loaded
        return [k for k, v in loaded.items() if isinstance(v, torch.Tensor)]

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, key: str) -> torch.Tensor:
        file = self._where[key]
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as handle:
                tensor: torch.Tensor = handle.get_tensor(key)
                return tensor
        return self._torch_files[file][key]


_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _files_of(path: Path) -> list[Path]:
    """The weight files of a file path, or of a Hugging Face model directory."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"'{path}' is neither a weights file nor a model directory")
    for name in _WEIGHT_FILES:
        index = path / f"{name}.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"'{index}' is not a weights index: {error}") from None
            return [path / f for f in dict.fromkeys(weight_map.values())]
        if (path / name).is_file():
            return [path / name]
    raise CheckpointError(
        f"'{path}' holds no weights: expected one of {', '.join(_WEIGHT_FILES)} (or its "
        ".index.json for sharded weights)"
    )


def tensor_source(source: Any) -> TensorSource:
    if isinstance(source, dict):
        return _DictSource(source)
    if isinstance(source, str | Path):
        return _FileSource(_files_of(Path(source)))
    raise TypeError(
        f"load_state_dict takes a state dict, a weights file or a model directory, got "
        f"{type(source).__name__}"
    )


def _group_of(param: nn.Parameter) -> tuple[GroupState, int] | None:
    manager = manager_of(param)
    if manager is not None:
        return manager.groups.lookup(param)
    owner = zero_parameter.owner_of(param)  # built under zero.Init, no engine yet
    state = owner.group_of(param) if owner is not None else None
    return None if state is None else (state, state.flat.position_of(param))


def _targets(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.state_dict(keep_vars=True).items()


@torch.no_grad()
def load_state_dict(module: nn.Module, source: Any, strict: bool = True) -> None:
    """Load full tensors (a dict, a file, or a model directory) into a possibly sharded model.

    Every rank calls it with the same source. Tied parameters are loaded from
    whichever of their names the source has. With `strict`, names the model
    has and the source lacks (or the reverse) are an error, raised before
    anything is written.
    """
    tensors = tensor_source(source)
    available = set(tensors.keys())
    targets = list(_targets(module))
    split = _split_of(manager_of_module(module))  # each rank keeps its slice of a split tensor
    first_name: dict[int, str] = {}
    names_of: dict[int, list[str]] = {}
    for key, target in targets:
        first_name.setdefault(id(target), key)
        names_of.setdefault(id(target), []).append(key)
    wanted = {key for key, _ in targets}
    missing = sorted(
        first_name[id(t)]
        for key, t in targets
        if first_name[id(t)] == key and not any(n in available for n in names_of[id(t)])
    )
    unexpected = sorted(available - wanted)
    if strict and (missing or unexpected):
        raise CheckpointError(
            "the weights do not match the model: "
            + " | ".join(
                part
                for part in (
                    f"missing: {', '.join(missing[:10])}" if missing else "",
                    f"unexpected: {', '.join(unexpected[:10])}" if unexpected else "",
                )
                if part
            )
            + "; load with strict=False to skip them"
        )
    for key, target in targets:
        if first_name[id(target)] != key:
            continue  # a tied name: loaded once, under its first name
        name = next((n for n in names_of[id(target)] if n in available), None)
        if name is None:
            continue
        value = tensors.get(name)
        expected = _whole_shape(split, target)
        if tuple(value.shape) != expected:
            raise CheckpointError(
                f"'{name}' has shape {tuple(value.shape)} in the weights, {expected} in the model"
            )
        if split is not None:
            value = local_part(split, target, value)
        found = _group_of(target) if isinstance(target, nn.Parameter) else None
        if found is not None:
            found[0].write_param(found[1], value)
        else:
            target.data.copy_(value.to(target.device))
