"""`GatheredParameters`: whole parameters outside forward, optionally modified by one rank."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING

from torch import nn

from zerodp import registry
from zerodp.comm import broadcast_tensors

if TYPE_CHECKING:
    from zerodp.comm import Comm
    from zerodp.engine import ZeroEngine
    from zerodp.params.sharded_group import ShardedGroup
    from zerodp.partition import FlatGroup


class GatheredParameters:
    """Gather `params` on entry; on exit, keep what `modifier_rank` wrote (if given) and re-shard.

    Every rank must enter the block with the same parameters: gathering and
    the final broadcast are collectives. Inside, the parameters are whole and
    may be read; with `modifier_rank=r`, rank r may also write them, and on exit
    its values are broadcast and every rank keeps its shard of them. Without a
    modifier rank, writes are discarded at stage 3. Parameters zerodp does not
    manage pass through untouched (a broadcast still applies to them).
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
        self._held: list[tuple[ZeroEngine, list[ShardedGroup]]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for engine, params in _by_engine(self.params):
            if engine is None or engine.stage3 is None:
                continue
            engine._abort_stale_backward()
            groups: list[ShardedGroup] = []
            for param in params:
                group = engine.stage3.group_of(param)
                if group is not None and group not in groups:
                    groups.append(group)
            groups.sort(key=lambda g: g.flat.index)
            for group in groups:
                engine.stage3.coordinator.hold(group)
            self._held.append((engine, groups))
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
                self._broadcast_from_modifier()
        finally:
            for engine, groups in self._held:
                if engine.stage3 is None:
                    continue
                for group in groups:
                    engine.stage3.coordinator.unhold(group)
            self._held = []

    def _broadcast_from_modifier(self) -> None:
        src = int(self.modifier_rank or 0)
        for engine, params in _by_engine(self.params):
            if engine is None:
                broadcast_tensors(_default_comm(), [p.data for p in params], src=src)
                continue
            flats: list[FlatGroup] = []
            for param in params:
                flat = engine.layout.group_of(param)
                if flat is not None and all(f is not flat for f in flats):
                    flats.append(flat)
            flats.sort(key=lambda f: f.index)
            loose = [p.data for p in params if engine.layout.group_of(p) is None]
            broadcast_tensors(engine.comm, [f.full for f in flats] + loose, src=src)
            for flat in flats:
                flat.take_shard_from_full()


def _by_engine(params: list[nn.Parameter]) -> list[tuple[ZeroEngine | None, list[nn.Parameter]]]:
    grouped: dict[int, tuple[ZeroEngine | None, list[nn.Parameter]]] = {}
    for param in params:
        engine = registry.engine_of(param)
        key = id(engine)
        grouped.setdefault(key, (engine, []))[1].append(param)
    return list(grouped.values())


def _default_comm() -> Comm:
    from zerodp.comm import Comm, ensure_process_group

    ensure_process_group()
    return Comm()
