"""`GatheredParameters`: whole parameters outside forward, optionally modified by one rank."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from zerodp import registry
from zerodp.comm import Comm, broadcast_tensors
from zerodp.params import zero_parameter


class GatheredParameters:
    """Gather `params` on entry; on exit keep what `modifier_rank` wrote (if given) and re-shard.

    Every rank must enter the block with the same parameters: gathering and
    the final broadcast are collectives. Inside, the parameters are whole and
    may be read; with `modifier_rank=r`, rank r may also write them in place
    (`param.copy_(...)`, `nn.init.*`), and on exit its values are broadcast
    and every rank keeps its shard of them. Without a modifier rank, writes to
    stage 3 parameters are discarded on exit. Parameters that are not sharded
    (stages 0-2, or not managed by zerodp) need no gathering; a modifier
    rank's values are still broadcast to all ranks.
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.params: list[nn.Parameter] = (
            [params] if isinstance(params, nn.Parameter) else list(params)
        )
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._held: list[tuple[Any, Any]] = []  # (owner, group)

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for owner, group in self._sharded_groups():
            owner.hold(group)
            self._held.append((owner, group))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._broadcast_from_modifier(int(self.modifier_rank))
        finally:
            for owner, group in reversed(self._held):
                owner.unhold(group)
            self._held = []

    def _sharded_groups(self) -> list[tuple[Any, Any]]:
        """(owner, group) pairs in a fixed order, so that every rank gathers alike."""
        found: list[tuple[Any, Any]] = []
        for param in self.params:
            owner = zero_parameter.owner_of(param)
            if owner is None:
                continue
            group = owner.group_of(param)
            if group is not None and all(group is not g for _, g in found):
                found.append((owner, group))
        found.sort(key=lambda pair: pair[1].flat.index)
        return found

    def _broadcast_from_modifier(self, src: int) -> None:
        flats: list[Any] = []
        loose: list[torch.Tensor] = []
        for param in self.params:
            flat = self._flat_group_of(param)
            if flat is None:
                loose.append(param.data)
            elif all(flat is not f for f in flats):
                flats.append(flat)
        flats.sort(key=lambda f: f.index)
        broadcast_tensors(_comm_for(self.params), [f.full for f in flats] + loose, src=src)
        for flat in flats:
            flat.take_shard_from_full()
            engine = registry.engine_of(flat.params[0])
            if engine is not None and engine.masters is not None:
                engine.masters.refresh_from_model(flat)

    @staticmethod
    def _flat_group_of(param: nn.Parameter) -> Any:
        owner = zero_parameter.owner_of(param)
        if owner is not None:
            group = owner.group_of(param)
            return None if group is None else group.flat
        engine = registry.engine_of(param)
        return None if engine is None else engine.layout.group_of(param)


def _comm_for(params: list[nn.Parameter]) -> Comm:
    for param in params:
        engine = registry.engine_of(param)
        if engine is not None:
            return engine.comm
    from zerodp.comm import ensure_process_group

    ensure_process_group()
    return Comm()
