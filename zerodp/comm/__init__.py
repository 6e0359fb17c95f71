"""Collective communication: the only importer of `torch.distributed` in zerodp.

`group` sets up the process group from torchrun's environment; `collectives`
wraps the collectives zerodp uses in typed calls that also count bytes.
"""

from zerodp.comm.collectives import CollectiveKind, Comm, CommStats, Handle, broadcast_tensors
from zerodp.comm.group import (
    default_device,
    destroy_process_group_if_owned,
    ensure_process_group,
    is_initialized,
)

__all__ = [
    "CollectiveKind",
    "Comm",
    "CommStats",
    "Handle",
    "broadcast_tensors",
    "default_device",
    "destroy_process_group_if_owned",
    "ensure_process_group",
    "is_initialized",
]
