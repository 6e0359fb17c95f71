"""Setting offload up for an engine: which groups, their host buffers, the checks on the disk."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from zerodp.comm import Comm
from zerodp.errors import ConfigError
from zerodp.group_state import HostBuffers
from zerodp.offload.policy import OffloadPolicy, Placement
from zerodp.offload.storage import OffloadStorage, free_bytes
from zerodp.partition import FlatGroup

# Per optimizer element: the fp32 copy and Adam's two moments (other optimizers keep less).
_STATE_BYTES_PER_ELEMENT = 12


def offloaded_groups(groups: list[FlatGroup], ratio: float) -> set[int]:
    """Orders of the trainable groups whose optimizer step runs on the host.

    Groups are taken in order until `ratio` of the trainable elements is offloaded
    (DeepSpeed's partial offload); the rest keeps its step on the device.
    """
    trainable = [(order, g) for order, g in enumerate(groups) if g.trainable]
    total = sum(g.owned.numel() for _, g in trainable)
    chosen: set[int] = set()
    taken = 0
    for order, group in trainable:
        if taken >= ratio * total - 1e-9:
            break
        chosen.add(order)
        taken += group.owned.numel()
    return chosen


def optimizer_copies(
    groups: list[FlatGroup],
    *,
    mixed: bool,
    kept_dtype: torch.dtype,
    policy: OffloadPolicy,
    storage: OffloadStorage | None,
) -> dict[int, tuple[torch.Tensor, HostBuffers | None]]:
    """The optimizer copy (and host buffers) of each group that needs one, by order.

    Taken before the model is cast, so an fp32 copy keeps the initial values' full
    precision. A group needs a copy under mixed precision (its fp32 master) and
    when its optimizer is offloaded (on the host, or in a file).
    """
    offloaded = offloaded_groups(groups, policy.ratio) if policy.offloads_optimizer else set()
    out: dict[int, tuple[torch.Tensor, HostBuffers | None]] = {}
    for order, flat in enumerate(groups):
        if not flat.trainable:
            continue
        owned = flat.owned.detach()
        if order not in offloaded or storage is None:
            if mixed:
                out[order] = (owned.to(torch.float32).clone(), None)
            continue
        numel = owned.numel()
        if policy.optimizer is Placement.FILE and policy.optimizer_path is not None:
            copy = storage.file_copy(policy.optimizer_path, f"group{order}.copy", owned.float())
        else:
            copy = storage.host_copy(owned, torch.float32)
        host = HostBuffers(
            grad=storage.host_empty(numel, torch.float32),
            grad_transfer=(
                storage.host_empty(numel, kept_dtype) if kept_dtype != torch.float32 else None
            ),
            model_staging=None,
        )
        out[order] = (copy, host)
    return out


def add_model_staging(
    copies: dict[int, tuple[torch.Tensor, HostBuffers | None]],
    model_dtype: torch.dtype,
    storage: OffloadStorage | None,
) -> None:
    """Offloaded groups of a half-precision model cast on the host before copying back."""
    if model_dtype == torch.float32 or storage is None:
        return
    for copy, host in copies.values():
        if host is not None:
            host.model_staging = storage.host_empty(copy.numel(), model_dtype)


def place_param_shards(
    groups: list[FlatGroup], policy: OffloadPolicy, storage: OffloadStorage
) -> None:
    """Stage 3 with `offload_param`: each sharded group's shard moves to the host (or a file)."""
    for order, flat in enumerate(groups):
        if flat.persistent:
            continue
        if policy.params is Placement.FILE and policy.params_path is not None:
            tensor = storage.file_empty(
                policy.params_path, f"group{order}.shard", flat.shard.numel(), flat.shard.dtype
            )
        else:
            tensor = storage.host_empty(flat.shard.numel(), flat.shard.dtype)
        flat.place_shard(tensor)


def check_offload_storage(groups: list[FlatGroup], policy: OffloadPolicy, comm: Comm) -> None:
    """NVMe paths are writable and have room, on every rank, before anything is written."""
    error: BaseException | None = None
    try:
        needed: dict[Path, int] = {}
        if policy.optimizer is Placement.FILE and policy.optimizer_path is not None:
            elements = sum(g.owned.numel() for g in groups if g.trainable)
            needed[policy.optimizer_path] = elements * _STATE_BYTES_PER_ELEMENT
        if policy.params is Placement.FILE and policy.params_path is not None:
            elements = sum(g.shard.numel() * g.shard.element_size() for g in groups)
            path = policy.params_path
            needed[path] = needed.get(path, 0) + elements
        for path, nbytes in needed.items():
            _check_writable(path)
            free = free_bytes(path)
            if free < nbytes:
                raise ConfigError(
                    f"offload nvme_path '{path}': this rank needs about {nbytes / 2**20:.1f} MiB "
                    f"for its optimizer state and shards, the file system has "
                    f"{free / 2**20:.1f} MiB free; free space or point nvme_path elsewhere"
                )
    except (ConfigError, OSError) as caught:
        error = caught
    comm.raise_if_any_failed(error)


def _check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ConfigError(
            f"offload nvme_path '{path}' is not writable ({os.strerror(error.errno or 0)}); "
            "point it at a directory on a local disk this process can write"
        ) from None
