"""Uneven inputs, every pairing: when ranks do different things at the same point, every rank
raises the same `UnevenInputsError` naming each rank's activity, at once, and nothing
mismatched reaches the backend ([Note: agreeing before a collective]).

The pairings of two activities that issue collectives (forward gather at stage 3, backward
reduction, optimizer step, save, load) run here, many per process: after a disagreement
nothing is left running, so the ranks start the next pairing together. The pairings with
the end of a script need processes that end: tools/exit_scenarios.py (`uneven/...`, each
rank's exit status), a covering set of them in test_exit_status.py and all of them with
`python tools/exit_stress.py --scenarios uneven`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zerodp
from tests.models import TinyNet, tiny_inputs
from tests.uneven import (
    CONFIGS,
    DESCRIBED,
    Outcome,
    activity_of,
    pairings,
    prepare,
    run_pairing,
)
from zerodp.comm import current_rank
from zerodp.comm.agreement import agreement

# Far below comms_timeout_s (60 s): the disagreement is found by the agreement's result.
_WITHIN_S = 10.0


def _pairings_on_rank(config_name: str, root: str) -> list[Outcome]:
    setup = CONFIGS[config_name]
    rank = current_rank()
    return [
        run_pairing(config_name, pairing, rank, Path(root) / f"{config_name}-{index}")
        for index, pairing in enumerate(pairings(setup.stage, with_end=False))
    ]


def _check(config_name: str, per_rank: list[list[Outcome]]) -> None:
    setup = CONFIGS[config_name]
    expected = pairings(setup.stage, with_end=False)
    assert [o.pairing for o in per_rank[0]] == expected
    for rank, outcomes in enumerate(per_rank):
        for outcome in outcomes:
            where = (config_name, rank, outcome)
            assert outcome.error.startswith(
                "UnevenInputsError: uneven inputs: the ranks are at different places: "
            ), where
            for other in range(setup.world_size):
                doing = DESCRIBED[activity_of(other, setup.world_size, outcome.pairing)]
                assert f"rank {other} {doing} after 2 optimizer steps" in outcome.error, where
            assert outcome.seconds < _WITHIN_S, where


@pytest.mark.parametrize("config_name", ["stage0", "stage1", "stage2", "stage3"])
def test_every_pairing_raises_uneven_inputs_on_every_rank(pools, tmp_path, config_name) -> None:
    per_rank = pools(2).run(_pairings_on_rank, config_name, str(tmp_path), timeout_s=600)
    _check(config_name, per_rank)


@pytest.mark.parametrize("config_name", ["shards1", "shards3"])
def test_every_pairing_raises_uneven_inputs_in_shard_groups(pools, tmp_path, config_name) -> None:
    """4 ranks in shard groups of 2: ranks 0-2 do one thing, rank 3 (sharing its shard group
    with rank 2) the other."""
    per_rank = pools(4).run(_pairings_on_rank, config_name, str(tmp_path), timeout_s=600)
    _check(config_name, per_rank)


def _forward_costs_nothing(stage: int, root: str) -> tuple[int, int]:
    """(agreements, collectives) a forward issued at `stage`."""
    rank = current_rank()
    torch.manual_seed(0)
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=CONFIGS[f"stage{stage}"].config())
    prepare(engine, rank, Path(root))
    calls = sum(engine.comm.stats.calls.values())
    agreed = agreement().num_agreed
    engine(tiny_inputs(rank, 3))
    result = (agreement().num_agreed - agreed, sum(engine.comm.stats.calls.values()) - calls)
    engine.destroy()
    return result


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_forward_below_stage_3_exchanges_nothing_and_agrees_on_nothing(
    pools, tmp_path, stage
) -> None:
    """Below stage 3 a forward is no activity the ranks can disagree on: it issues no
    collective, so it costs no agreement either; the rank's next activity agrees."""
    assert pools(2).run(_forward_costs_nothing, stage, str(tmp_path)) == [(0, 0), (0, 0)]


def _agreements_per_step(stage: int, stall_checks: bool) -> list[int]:
    """Agreements in each part of a training step: forward, backward, step."""
    rank = current_rank()
    config = CONFIGS[f"stage{stage}"].config()
    config["comms_stall_checks"] = stall_checks
    torch.manual_seed(0)
    engine, _, _, _ = zerodp.initialize(model=TinyNet(), config=config)
    counts = []
    for step in range(2):
        before = agreement().num_agreed
        output = engine(tiny_inputs(rank, step))
        after_forward = agreement().num_agreed
        engine.backward(output.square().mean())
        after_backward = agreement().num_agreed
        engine.step()
        counts = [after_forward - before, after_backward - after_forward]
        counts.append(agreement().num_agreed - after_backward)
    engine.destroy()
    return counts


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_agreement_per_activity_and_none_without_stall_checks(pools, stage) -> None:
    """What the agreement costs: one small collective per forward that gathers (stage 3),
    per backward and per optimizer step; nothing with comms_stall_checks off."""
    expected = [1 if stage == 3 else 0, 1, 1]
    assert pools(2).run(_agreements_per_step, stage, True) == [expected, expected]
    assert pools(2).run(_agreements_per_step, stage, False) == [[0, 0, 0], [0, 0, 0]]
