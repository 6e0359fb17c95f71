"""Recognising the data-parallel wrappers of torch.distributed (DDP, FSDP, FSDP2).

A model zerodp manages must not also be wrapped by one of them: both would
reduce (or shard) the same gradients. `zerodp.engine.guards` uses these to refuse it
with a message naming what to do instead.
"""

from __future__ import annotations

import sys
from types import CodeType

from torch import nn


def _forward_codes() -> frozenset[CodeType]:
    codes = []
    try:
        from torch.nn.parallel import DistributedDataParallel

        codes.append(DistributedDataParallel.forward.__code__)
    except ImportError:  # pragma: no cover - builds without distributed
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        codes.append(FullyShardedDataParallel.forward.__code__)
    except ImportError:  # pragma: no cover
        pass
    return frozenset(codes)


_WRAPPER_FORWARDS = _forward_codes()
_WRAPPER_NAMES = {
    "DistributedDataParallel": "DistributedDataParallel (DDP)",
    "FullyShardedDataParallel": "FullyShardedDataParallel (FSDP)",
}


def wrapper_calling(frames_up: int = 12) -> str | None:
    """The wrapper whose forward is calling the current module's forward, if any."""
    frame = sys._getframe(1)
    for _ in range(frames_up):
        if frame is None:
            return None
        if frame.f_code in _WRAPPER_FORWARDS:
            qualname = frame.f_code.co_qualname.split(".")[0]
            return _WRAPPER_NAMES.get(qualname, qualname)
        frame = frame.f_back  # type: ignore[assignment]
    return None


def fully_sharded_by_fsdp2(module: nn.Module) -> bool:
    """Whether `fully_shard` (FSDP2) has taken `module` over (it changes the module's class)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, FSDPModule)
