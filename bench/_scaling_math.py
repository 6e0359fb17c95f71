"""The arithmetic of bench/scaling.py: the ZeRO paper's lines and the depth search.

Kept free of torch.distributed so tests/unit/test_scaling_math.py checks it in
one process.

Traffic is counted the way zerodp's `engine.comm.stats` and the bench's
`CollectiveCounter` count it: the bytes of the full tensor each collective works
on (all-reduce tensor, reduce-scatter input, all-gather output). What one rank
sends over a ring is a fraction of that: (N-1)/N of it for a reduce-scatter or an
all-gather, 2(N-1)/N for an all-reduce (a reduce-scatter then an all-gather).
The paper's per-rank figures (2Ψ for DDP and stages 1-2, 3Ψ for stage 3, in
elements) are those ring costs as N grows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# Full-tensor multiples of the model's bytes each stage moves per step, by kind.
# Stage 0 all-reduces the gradients; stages 1-2 reduce-scatter them and all-gather
# the updated parameters; stage 3 all-gathers the parameters for forward and again
# for backward, and reduce-scatters the gradients.
IDEAL_LOGICAL: dict[int, dict[str, int]] = {
    0: {"all_reduce": 1},
    1: {"reduce_scatter": 1, "all_gather": 1},
    2: {"reduce_scatter": 1, "all_gather": 1},
    3: {"reduce_scatter": 1, "all_gather": 2},
}

_RING_SHARE: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,  # a pipelined ring broadcast: every rank but one receives
    "reduce": lambda n: (n - 1) / n,
}


def ring_share(kind: str, world_size: int) -> float:
    """The fraction of a collective's full-tensor bytes one rank sends on a ring."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if kind not in _RING_SHARE:
        raise ValueError(f"unknown collective kind {kind!r}; choose from {', '.join(_RING_SHARE)}")
    return _RING_SHARE[kind](world_size)


def wire_bytes(by_kind: Mapping[str, int], world_size: int) -> float:
    """Bytes one rank sends on a ring for the given full-tensor bytes per collective kind."""
    return sum(nbytes * ring_share(kind, world_size) for kind, nbytes in by_kind.items())


def ideal_logical_bytes(model_bytes: int, stage: int) -> int:
    """The full-tensor bytes a stage moves per step, for a model of `model_bytes` bytes."""
    return model_bytes * sum(IDEAL_LOGICAL[stage].values())


def ideal_wire_bytes(model_bytes: int, stage: int, world_size: int) -> float:
    """The ZeRO paper's per-rank traffic: 2Ψ(N-1)/N for stages 0-2, 3Ψ(N-1)/N for stage 3."""
    kinds = {kind: model_bytes * times for kind, times in IDEAL_LOGICAL[stage].items()}
    return wire_bytes(kinds, world_size)


def ideal_fit_params(budget_bytes: int, baseline_bytes: int, stage: int, world_size: int) -> int:
    """Parameters whose fp32 AdamW model state (ZeRO paper's figure) fits the budget's headroom.

    Per rank: 16 bytes per parameter at stage 0, 4 + 4 + 8/N at stage 1,
    4 + 12/N at stage 2, 16/N at stage 3. Activations and buffers are ignored,
    so this is an upper bound on what can train.
    """
    per_param = {
        0: 16.0,
        1: 8 + 8 / world_size,
        2: 4 + 12 / world_size,
        3: 16 / world_size,
    }[stage]
    return max(0, int((budget_bytes - baseline_bytes) // per_param))


@dataclass
class DepthSearch:
    """The largest depth in [1, limit] for which `fits(depth)` holds.

    From `start` (a guess), doubling while it fits or halving while it fails,
    then bisection between the last fit and the first failure. Assumes fitting
    is monotone in depth (a deeper model never fits where a shallower one
    fails). `tried` records every attempt in order, for the report.
    """

    fits: Callable[[int], bool]
    start: int = 1
    limit: int = 1024
    tried: list[tuple[int, bool]] = field(default_factory=list)

    def _probe(self, depth: int) -> bool:
        ok = self.fits(depth)
        self.tried.append((depth, ok))
        return ok

    def run(self) -> int:
        """The largest fitting depth; 0 if depth 1 fails; `limit` if it still fits there."""
        if not 1 <= self.start <= self.limit:
            raise ValueError(
                f"need 1 <= start <= limit, got start {self.start}, limit {self.limit}"
            )
        good, bad = 0, self.limit + 1  # good fits (0: none known), bad fails (limit+1: none known)
        depth = self.start
        if self._probe(depth):
            good = depth
            while bad > self.limit and good < self.limit:
                depth = min(good * 2, self.limit)
                if self._probe(depth):
                    good = depth
                else:
                    bad = depth
        else:
            bad = depth
            while good == 0 and bad > 1:
                depth = bad // 2
                if self._probe(depth):
                    good = depth
                else:
                    bad = depth
        while bad - good > 1 and good > 0:
            mid = (good + bad) // 2
            if self._probe(mid):
                good = mid
            else:
                bad = mid
        return good
