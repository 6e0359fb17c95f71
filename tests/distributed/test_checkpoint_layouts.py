"""Checkpoints that outlive their layout: saved at one (D, S, T, stage), loaded at another.

Each save (`tests.layout_setup.save_both`) trains the tiny Llama one step beside the
one-process reference, saves at the boundary, runs the next window's first micro-batch
and saves inside the window. Each load runs under another layout and stage and checks
that:
- the loaded weights equal the saved ones bitwise (0.0: a load moves values, it adds
  nothing, whatever the cut of the slices);
- every later loss, global gradient norm and weight matches the uninterrupted run
  computed in the worker within 1e-5 (fp32 round-off: the reference multiplies whole
  matrices and attends over whole sequences, the engines add slices' partial sums and
  head shards in another order; a wrong slice, a moment at the wrong offset or a window
  gradient averaged over the wrong ranks is off by a whole update: AdamW at lr 1e-2 moves
  each element by about 1e-2 a step). SGD
  steps by the gradient itself, so a window's combined gradient shows in its weights;
  AdamW checks the moments.

World 2 (one spawn): T=2 -> D=2 and D=2 -> T=2 (T = 1 <-> 2: row-parallel weights read
across cuts, column-parallel ones directly), S=2 -> D=2, T=2 -> S=2, each at a boundary
and inside a window with SGD and with AdamW; S=2 -> T=2 with SGD. The windows are saved
at stages that keep local sums (0, 1: each rank's sums of its slice, combined at the
load as the saved dims say) and at stages that keep averages (2, 3), and loaded at other
stages; one load reads one parameter per round (the bounded-memory path, with ranks that
hold nothing of a parameter in a round), and windows of slices load at the same T too.
World 4: T=2 x D=2 -> T=1 x D=4, boundary and window, SGD and AdamW; a window at stage 1
loaded at the same dims under another tensor-parallel plan (a weight sliced <-> whole),
against the run never interrupted. A changed split dimension (another tensor-parallel plan)
is refused naming both layouts, and the engine is left as it was. `ZERODP_LAYOUT_SWEEP=1`
runs every stage pair of every direction (minutes on two cores).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zerodp
from tests.layout_setup import Load, layout, sweep
from tests.tp_reference import USER_PLAN, block_batch, block_loss, block_net, tp_config
from zerodp.errors import CheckpointError

pytest.importorskip("transformers")

BOUND = 1e-5  # fp32 round-off, see the module docstring
TAGS = ("boundary", "window")

WORLD_2_SAVES = [
    ("t2-sgd", layout(1, tensor=2)),  # a window's local sums of slices
    ("t2-adamw", layout(2, tensor=2, optimizer="adamw")),  # a window's averages of slices
    ("d2-sgd", layout(0)),
    ("d2-adamw", layout(3, optimizer="adamw")),
    ("s2-sgd", layout(1, sequence=2)),
    ("s2-adamw", layout(2, sequence=2, optimizer="adamw")),
]
WORLD_2_TARGETS = [  # (save, the layout it loads at)
    ("t2-sgd", layout(3)),  # T=2 -> D=2
    ("t2-adamw", layout(0, optimizer="adamw")),
    ("d2-sgd", layout(2, tensor=2)),  # D=2 -> T=2
    ("d2-adamw", layout(1, tensor=2, optimizer="adamw")),
    ("s2-sgd", layout(3)),  # S=2 -> D=2
    ("s2-adamw", layout(0, optimizer="adamw")),
    ("t2-sgd", layout(2, sequence=2)),  # T=2 -> S=2
    ("t2-adamw", layout(3, sequence=2, optimizer="adamw")),
    ("s2-sgd", layout(2, tensor=2)),  # S=2 -> T=2
]
WORLD_2_LOADS = [Load(saved, case, tag) for saved, case in WORLD_2_TARGETS for tag in TAGS]
# One parameter per round: the rounds agree though a rank may hold nothing of a parameter.
WORLD_2_LOADS.append(Load("t2-sgd", layout(3), "window", round_bytes=1))
# The same T: a window's local sums of slices back as they were (the same layout), and
# combined at another stage.
WORLD_2_LOADS += [Load("t2-sgd", layout(stage, tensor=2), "window") for stage in (1, 3)]

WORLD_4_SAVES = [
    ("t2d2-sgd", layout(1, tensor=2)),
    ("t2d2-adamw", layout(3, tensor=2, optimizer="adamw")),
]
WORLD_4_LOADS = [Load("t2d2-sgd", layout(3), tag) for tag in TAGS] + [
    Load("t2d2-adamw", layout(1, optimizer="adamw"), tag) for tag in TAGS
]


def check(results: list[dict[str, Any]], loads: list[Load], world: int) -> list[float]:
    """Every load on every rank: bitwise loaded, within `BOUND` after, at the expected D.
    Returns the seconds each load took (rank 0)."""
    for rank_result in results:
        assert len(rank_result["loads"]) == len(loads)
        for load, got in zip(loads, rank_result["loads"], strict=True):
            where = got["where"]
            assert got["loaded"] == 0.0, where  # bitwise: a load only moves values
            for what in ("loss", "norm", "weights"):
                assert got[what] <= BOUND, (where, what, got)
            ranks_per_batch = load.case.sequence * tensor_size(load.case)
            assert got["data_parallel_size"] == world // ranks_per_batch, where
    return [got["seconds"] for got in results[0]["loads"]]


def report(results: list[dict[str, Any]], seconds: list[float]) -> None:
    """The cost and the largest differences, for `pytest -s` (the docs quote them)."""
    saves = sum(save["seconds"] for save in results[0]["saves"].values())
    worst = {
        what: max(got[what] for result in results for got in result["loads"])
        for what in ("loaded", "loss", "norm", "weights")
    }
    print(
        f"\n{len(results[0]['saves'])} saves {saves:.1f} s, {len(seconds)} loads "
        f"{sum(seconds):.1f} s; largest differences {worst}"
    )


def tensor_size(case: Any) -> int:
    return case.extra.get("tensor_parallel", {}).get("autotp_size", 1)


def test_world_2_loads_across_data_sequence_and_tensor_layouts(pools: Any, tmp_path: Path) -> None:
    results = pools(2).run(sweep, WORLD_2_SAVES, WORLD_2_LOADS, str(tmp_path), timeout_s=600)
    report(results, check(results, WORLD_2_LOADS, 2))


def test_world_4_tensor_and_data_to_data_only(pools: Any, tmp_path: Path) -> None:
    """T=2 x D=2 -> T=1 x D=4."""
    results = pools(4).run(sweep, WORLD_4_SAVES, WORLD_4_LOADS, str(tmp_path), timeout_s=600)
    report(results, check(results, WORLD_4_LOADS, 4))


def changed_plan(workdir: str) -> dict[str, Any]:
    """Save a model split by the user's plan (fc2 row-parallel: along dim 1) at T=2, load it
    where fc2 is column-parallel (dim 0): refused before anything changes."""
    engine, _, _, _ = zerodp.initialize(model=block_net(), config=tp_config(1, plan=USER_PLAN))
    engine.save_checkpoint(workdir, tag="plan")
    engine.destroy()
    other = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "colwise"}
    engine, _, _, _ = zerodp.initialize(model=block_net(), config=tp_config(1, plan=other))
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(workdir, tag="plan")
    after = engine.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    engine.destroy()
    return {"message": str(info.value), "unchanged": unchanged}


def test_a_changed_split_dimension_is_refused_naming_both_layouts(
    pools: Any, tmp_path: Path
) -> None:
    for result in pools(2).run(changed_plan, str(tmp_path)):
        message = result["message"]
        assert "saved with tensor_parallel.autotp_size 2, this engine has 2" in message
        assert "splits 'blocks.0.fc2.weight' along dim 1, this engine along dim 0" in message
        assert "zerodp consolidate" in message, message
        assert result["unchanged"]


WHOLE_FC2 = {"blocks.*.fc1": "colwise_gather_output"}  # USER_PLAN's fc1 cut, fc2 left whole


def _micro_step(engine: Any, index: int) -> None:
    """Micro-batch `index` of the run (two a step): its backward and `step()`."""
    engine.backward(block_loss(engine, block_batch(index, engine.data_parallel_rank)))
    engine.step()


def window_under_another_plan(workdir: str, saved_plan: Any, plan: Any) -> float:
    """T=2 x D=2, stage 1 (each rank's local sums kept), SGD: one step and the next window's
    first micro-batch under `saved_plan`, saved inside the window; loaded under `plan` (the
    same dims, fc2 cut otherwise), the window's second micro-batch and the step. Returns the
    largest difference from the run under `plan` never interrupted."""

    def engine_with(cut: Any) -> Any:
        config = tp_config(1, gas=2, optimizer="SGD", plan=cut)
        return zerodp.initialize(model=block_net(), config=config)[0]

    engine = engine_with(plan)
    for index in range(4):
        _micro_step(engine, index)
    straight = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    engine.destroy()
    engine = engine_with(saved_plan)
    for index in range(3):
        _micro_step(engine, index)
    engine.save_checkpoint(workdir, tag="window")
    engine.destroy()
    engine = engine_with(plan)
    engine.load_checkpoint(workdir, tag="window")
    _micro_step(engine, 3)
    resumed = engine.state_dict()
    engine.destroy()
    return max((resumed[k].float() - straight[k].float()).abs().max().item() for k in straight)


def test_a_window_loads_under_another_plan_at_the_same_dims(pools: Any, tmp_path: Path) -> None:
    """fc2 saved as slices and loaded whole, and the reverse, beside weights cut as saved in
    the same groups: every group's window gradient is combined alike (the cut one must not
    leave its group's local sums marked averaged, or them unreduced)."""
    for index, (saved_plan, plan) in enumerate(((USER_PLAN, WHOLE_FC2), (WHOLE_FC2, USER_PLAN))):
        workdir = str(tmp_path / f"plan{index}")
        worst = pools(4).run(window_under_another_plan, workdir, saved_plan, plan, timeout_s=300)
        assert max(worst) <= BOUND, (saved_plan, plan, worst)


def every_pair() -> tuple[list[tuple[str, Any]], list[Load]]:
    """Every stage of each saving layout, each loaded at every stage of every other."""
    layouts = {"T2": {"tensor": 2}, "D2": {}, "S2": {"sequence": 2}}
    saves, loads = [], []
    for (name, sizes), stage, optimizer in itertools.product(
        layouts.items(), range(4), ("sgd", "adamw")
    ):
        saved = f"{name}-{stage}-{optimizer}"
        saves.append((saved, layout(stage, optimizer=optimizer, **sizes)))
        for other, other_sizes in layouts.items():
            if other == name or (other == "S2" and name != "T2"):
                continue
            for target, tag in itertools.product(range(4), TAGS):
                loads.append(Load(saved, layout(target, optimizer=optimizer, **other_sizes), tag))
    return saves, loads


@pytest.mark.skipif(
    os.environ.get("ZERODP_LAYOUT_SWEEP") != "1",
    reason="the full sweep of stage pairs: set ZERODP_LAYOUT_SWEEP=1 (minutes on two cores)",
)
@pytest.mark.timeout(3600)
def test_every_stage_pair_of_every_direction(pools: Any, tmp_path: Path) -> None:
    saves, loads = every_pair()
    results = pools(2).run(sweep, saves, loads, str(tmp_path), timeout_s=3600)
    report(results, check(results, loads, 2))
