"""At `initialize`: every rank has the same config, model, world size and versions.

ZeRO needs every rank to issue the same collectives on the same layout; a
rank with another stage, micro batch or model otherwise ends in a backend
abort ("Received data size doesn't match") or, worse, trains on with ranks
disagreeing. One small collective (a digest per item) finds a difference
before the first real collective; only then are the details of the items
that differ gathered, so the error names them, the same on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from torch import nn

from zerodp.comm import Comm
from zerodp.config import ZeroDPConfig
from zerodp.errors import UsageError
from zerodp.version import __version__

_SHOWN = 5

# Config values that name a rank's own resources: each rank may give its own
# (an NVMe path on its local disk), so they are not part of the agreement.
_RANK_LOCAL_KEYS = frozenset(
    {
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_param.nvme_path",
    }
)


class RankMismatchError(UsageError):
    """Ranks were started with different configs, models or software (named in the message)."""


def check_ranks_agree(comm: Comm, config: ZeroDPConfig, module: nn.Module) -> None:
    """Raise RankMismatchError on every rank unless all ranks describe the same run."""
    view = os.environ.get("WORLD_SIZE")
    if view is not None and view.strip().isdigit() and int(view) != comm.world_size:
        raise RankMismatchError(
            f"rank {comm.rank}: WORLD_SIZE is {view} but the process group has "
            f"{comm.world_size} ranks; the config's batch sizes were derived for the wrong "
            "size: launch with torchrun (or zerodp run) and leave WORLD_SIZE to it"
        )
    details: dict[str, dict[str, str]] = {
        "versions": {"zerodp": __version__, "torch": torch.__version__},
        "world size": {"world_size": str(comm.world_size)},
        "config": {
            key: value
            for key, value in _flatten(config.model_dump(mode="json")).items()
            if key not in _RANK_LOCAL_KEYS
        },
        "model": _model_items(module),
    }
    digests = {name: _digest(items) for name, items in details.items()}
    views = comm.all_gather_object(digests)
    differing = [name for name in details if len({v[name] for v in views}) > 1]
    if not differing:
        return
    everyone = comm.all_gather_object({name: details[name] for name in differing})
    parts = [_explain(name, [d[name] for d in everyone]) for name in differing]
    raise RankMismatchError(
        "ranks disagree at start-up: " + "; ".join(parts) + ". Every rank must run the same "
        "script with the same config, model and software"
    )


def _model_items(module: nn.Module) -> dict[str, str]:
    items = {
        f"parameter {name}": f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')} "
        f"requires_grad={p.requires_grad}"
        for name, p in module.named_parameters()
    }
    items.update(
        {
            f"buffer {name}": f"{tuple(b.shape)} {str(b.dtype).removeprefix('torch.')}"
            for name, b in module.named_buffers()
        }
    )
    return items


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(value, dict) and value:
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: json.dumps(value, sort_keys=True, default=str)}


def _digest(items: dict[str, str]) -> str:
    text = json.dumps(items, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _explain(name: str, per_rank: list[dict[str, str]]) -> str:
    keys = sorted({k for items in per_rank for k in items})
    differing = [k for k in keys if len({items.get(k, "(absent)") for items in per_rank}) > 1]
    shown = []
    for key in differing[:_SHOWN]:
        values = ", ".join(
            f"rank {r}: {items.get(key, '(absent)')}" for r, items in enumerate(per_rank)
        )
        shown.append(f"{key} ({values})")
    more = len(differing) - _SHOWN
    tail = f" and {more} more" if more > 0 else ""
    return f"{name} differs in " + "; ".join(shown) + tail
