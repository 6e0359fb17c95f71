"""torch's generic join context (`torch.distributed.algorithms.Join`) for zerodp's engine.

The engine is a joinable in torch's sense (`join_hook`, `join_device`,
`join_process_group`, a `_join_config` that `Join` sets), so `Join([engine])`
works as it does for DDP, and `engine.join()` builds that context. Only the
protocol lives here (the one place that imports torch's join module); what a
rank that ran out of inputs does in each round is the engine's
([Note: joining uneven inputs] in `zerodp.engine.uneven_join`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

__all__ = [
    "CallbackJoinHook",
    "Join",
    "Joinable",
    "disabled_join_config",
    "join_enabled",
    "notify_join",
]


def disabled_join_config() -> Any:
    """The config of a joinable outside any join context (what `Joinable.__init__` sets)."""
    return _JoinConfig.construct_disabled_join_config()


def join_enabled(joinable: Any) -> bool:
    """Whether `joinable` is inside an enabled join context, as its first joinable."""
    config = joinable._join_config
    return bool(config.enable and config.is_first_joinable)


def notify_join(joinable: Any) -> int | None:
    """A rank still training starts a round: how many ranks are still training (None when
    outside a join context). Pairs with the all-reduce of the ranks that joined."""
    work = Join.notify_join_context(joinable)
    if work is None:
        return None
    work.wait()
    return int(work.result()[0].item())


class CallbackJoinHook(JoinHook):
    """A join hook whose main hook shadows one round and whose post hook ends the join."""

    def __init__(self, main: Callable[[], None], post: Callable[[bool], None]) -> None:
        self._main = main
        self._post = post

    def main_hook(self) -> None:
        self._main()

    def post_hook(self, is_last_joiner: bool) -> None:
        self._post(is_last_joiner)
