"""Collective communication: zerodp's one way to `torch.distributed`.

`group` sets up the process group from torchrun's environment; `collectives`
wraps the collectives zerodp uses in typed calls (`Comm`) that count bytes (`stats`)
and return handles that hear from the other ranks while they wait (`handles`);
`faults` is failure handling, which the collectives call into. Only `comm/`,
`checkpoint/` (DCP), `launch/` (torchrun) and `testing/` may import
`torch.distributed`; ruff's banned-API rule enforces it (pyproject.toml).
"""

from zerodp.comm.collectives import Comm, broadcast_tensors
from zerodp.comm.group import (
    current_rank,
    current_world_size,
    default_device,
    destroy_process_group_if_owned,
    ensure_process_group,
    is_initialized,
)
from zerodp.comm.handles import Handle
from zerodp.comm.stats import CollectiveKind, CommStats

__all__ = [
    "CollectiveKind",
    "Comm",
    "CommStats",
    "Handle",
    "broadcast_tensors",
    "current_rank",
    "current_world_size",
    "default_device",
    "destroy_process_group_if_owned",
    "ensure_process_group",
    "is_initialized",
]
