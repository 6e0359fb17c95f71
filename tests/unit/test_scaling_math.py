"""bench/_scaling_math.py: the ZeRO paper's traffic and memory lines, and the depth search."""

from __future__ import annotations

import pytest

from bench._scaling_math import (
    DepthSearch,
    ideal_fit_params,
    ideal_logical_bytes,
    ideal_wire_bytes,
    ring_share,
    wire_bytes,
)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ideal_traffic_is_the_papers_two_and_three_psi(n: int) -> None:
    psi = 1000
    share = (n - 1) / n
    assert ideal_wire_bytes(psi, 0, n) == pytest.approx(2 * psi * share)
    assert ideal_wire_bytes(psi, 1, n) == pytest.approx(2 * psi * share)
    assert ideal_wire_bytes(psi, 2, n) == pytest.approx(2 * psi * share)
    assert ideal_wire_bytes(psi, 3, n) == pytest.approx(3 * psi * share)
    assert [ideal_logical_bytes(psi, s) for s in range(4)] == [psi, 2 * psi, 2 * psi, 3 * psi]


def test_wire_bytes_weights_each_kind_by_its_ring_cost() -> None:
    kinds = {"all_reduce": 400, "reduce_scatter": 400, "all_gather": 800}
    assert wire_bytes(kinds, 4) == pytest.approx(400 * 1.5 + 400 * 0.75 + 800 * 0.75)
    assert wire_bytes({}, 4) == 0
    assert ring_share("all_gather", 1) == 0


def test_ring_share_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="unknown collective kind 'alltoall'"):
        ring_share("alltoall", 2)
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        ring_share("all_gather", 0)


def test_ideal_fit_params_divides_the_headroom_by_bytes_per_param() -> None:
    budget, base = 1_600_000, 0
    assert ideal_fit_params(budget, base, 0, 2) == 100_000  # 16 bytes
    assert ideal_fit_params(budget, base, 1, 2) == 133_333  # 8 + 4
    assert ideal_fit_params(budget, base, 2, 2) == 160_000  # 4 + 6
    assert ideal_fit_params(budget, base, 3, 2) == 200_000  # 8
    assert ideal_fit_params(budget, base, 3, 4) == 400_000  # 4
    assert ideal_fit_params(100, 200, 3, 2) == 0  # no headroom at all


def _search(largest: int, start: int, limit: int = 1024) -> DepthSearch:
    search = DepthSearch(lambda d: d <= largest, start=start, limit=limit)
    assert search.run() == min(largest, limit)
    depths = [d for d, _ in search.tried]
    assert len(depths) == len(set(depths)), search.tried  # nothing tried twice
    return search


@pytest.mark.parametrize("largest", [1, 2, 3, 7, 8, 9, 31, 100])
@pytest.mark.parametrize("start", [1, 5, 16, 64])
def test_depth_search_finds_the_largest_fitting_depth(largest: int, start: int) -> None:
    search = _search(largest, start)
    assert (largest, True) in search.tried
    assert (largest + 1, False) in search.tried


def test_depth_search_edges() -> None:
    assert DepthSearch(lambda d: False, start=4).run() == 0
    capped = _search(10_000, 3, limit=40)
    assert capped.tried[-1] == (40, True)
    assert len(_search(20, 16).tried) <= 2 + 5  # one probe up, then bisection of 16..32
    with pytest.raises(ValueError, match="need 1 <= start <= limit"):
        DepthSearch(lambda d: True, start=0).run()
