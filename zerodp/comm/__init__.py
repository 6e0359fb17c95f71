"""Collective communication: zerodp's one way to `torch.distributed`.

`group` sets up the process group from torchrun's environment; `collectives`
wraps the collectives zerodp uses in typed calls (`Comm`) that count bytes (`stats`)
and return handles that hear from the other ranks while they wait (`handles`);
`faults` is failure handling, which the collectives call into. Only `comm/`,
`checkpoint/` (DCP), `launch/` (torchrun) and `testing/` may import
`torch.distributed`; ruff's banned-API rule enforces it (pyproject.toml).

The names from `public` (`get_rank`, `all_reduce`, `barrier`, `init_distributed`, ...)
are DeepSpeed's `deepspeed.comm` for scripts, over torch.distributed. They are a face
for users: zerodp's own modules never import `zerodp.comm.public` (an import contract),
and none of its names is one the internals import from here (`is_initialized` is the
same function in both). They are listed once, in `public.__all__`, which this package's
`__all__` extends.
"""

import zerodp.comm.public as _public
from zerodp.comm.collectives import Comm, broadcast_tensors
from zerodp.comm.handles import Handle
from zerodp.comm.process_group import (
    current_rank,
    current_world_size,
    default_device,
    default_store,
    destroy_process_group_if_owned,
    ensure_process_group,
)
from zerodp.comm.public import *  # noqa: F403  (DeepSpeed's names, listed once: `_public.__all__`)
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
    "default_store",
    "destroy_process_group_if_owned",
    "ensure_process_group",
]
__all__ += _public.__all__
