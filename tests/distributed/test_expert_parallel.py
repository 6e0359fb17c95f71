"""Expert parallelism in the engine, exact: tiny Hugging Face MoE models (8 experts, top-2).

Each case trains with `"expert_parallel": {"enabled": true, "autoep_size": E}` beside one
process on the same data (tests/expert_setup.py): every micro-batch's loss, each step's
global grad norm and every weight after 3 steps, fp32 within 1e-5, at ZeRO stages 0-3, with
accumulation, clipping, AdamW and SGD (SGD moves the weights by the gradient itself, so a
scale error in the experts' reduction shows). World 2 at E=2 on Qwen3-MoE and Mixtral, with
the auxiliary load-balancing loss in the loss, with half the experts given no token (on
rank 1 every expert it holds is idle at first), in bf16 (against the same recipe in one
process: a bf16 model, fp32 master weights), with activation checkpointing (the dispatch
runs again in backward), and with each micro-batch's backward run twice on a retained graph
(both all-to-alls' backwards run twice); world 4 at E=2 x D=2, E=4, and E=2 x S=2
(the same ranks split the sequences and hold the experts). Checkpoints saved at E=2 resume
without expert parallelism and at another number of data ranks; windows resume at another
E, one saved by shard groups included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.expert_setup import (
    Case,
    export_case,
    plain_trainer_run,
    refused_cases,
    resume,
    resume_inside_window,
    run_cases,
    save_after,
    save_inside_window,
    sft_single_process,
    sft_with_experts,
    trainer_with_experts,
)

pytest.importorskip("transformers")

WORLD_2 = [
    Case(0),
    Case(1, gas=2, clip=0.05),
    Case(2, optimizer="adamw", aux=True),
    Case(3),
    Case(3, gas=2, optimizer="adamw", clip=0.05, aux=True),
    Case(3, idle_pairs=2),
    Case(1, idle_pairs=2, optimizer="adamw"),
    Case(0, model="mixtral", optimizer="adamw", clip=0.05),
    Case(2, model="mixtral", gas=2, aux=True),
    Case(3, model="mixtral"),
    Case(3, bf16=True),
    Case(1, bf16=True, gas=2),
    Case(3, checkpointing=True, gas=2, aux=True),
    Case(2, retained=True, optimizer="adamw"),
    Case(3, retained=True),
    # The experts named by the config: zerodp's patterns, and DeepSpeed's regular expression.
    Case(2, experts_named=(("plan", ["model.layers.*.mlp.experts"]),)),
    Case(
        1,
        model="mixtral",
        experts_named=(("moe_layer_pattern", r"model\.layers\.\d+\.mlp"),),
    ),
]
WORLD_4 = [
    Case(2, gas=2, optimizer="adamw", aux=True),  # E=2 x D=2: two EP groups
    Case(3, expert=4),
    Case(1, expert=4, model="mixtral", clip=0.05),
    Case(3, sequence=2, gas=2),  # E=2 x S=2 over the same ranks, D=2
    Case(0, sequence=2, optimizer="adamw"),
]


def check(cases: list[Case], results: list[list[dict[str, Any]]]) -> None:
    world = len(results)
    for rank_results in results:
        for case, result in zip(cases, rank_results, strict=True):
            assert result["experts_held"] == [result["expected_held"]], (case, result)
            assert result["data_parallel_size"] == world // case.sequence, (case, result)
            # A rank alone in its expert-data group keeps its experts whole: no full buffer
            # filled from the shard before each use (held twice while in use).
            gathered = case.stage == 3 and result["expert_data_size"] > 1
            assert result["expert_groups_gathered"] == [gathered], (case, result)
    print("\n".join(f"{c}: {r}" for c, r in zip(cases, results[0], strict=True)))


def test_world_2_matches_one_process(pools: Any) -> None:
    check(WORLD_2, pools(2).run(run_cases, WORLD_2))


def test_world_4_matches_one_process(pools: Any) -> None:
    check(WORLD_4, pools(4).run(run_cases, WORLD_4, timeout_s=400))


def test_a_checkpoint_resumes_without_experts_split_and_at_another_d(
    pools: Any, tmp_path: Path
) -> None:
    """Saved at E=2 (2 ranks, stage 2): resumed at E=1 (no expert parallelism) at stage 3,
    and at E=2 x D=2 on 4 ranks at stage 1. A checkpoint holds each expert tensor whole
    (experts first, E slices at their offsets), so any E reads it."""
    saved = Case(2, optimizer="adamw")
    directory = str(tmp_path / "saved")
    pools(2).run(save_after, saved, 2, directory)
    for world, case in ((2, Case(3, expert=1, optimizer="adamw")), (4, Case(1, optimizer="adamw"))):
        results = pools(world).run(resume, saved, 2, 2, case, directory)
        for result in results:
            assert result["data_parallel_size"] == world, result
            assert result["loaded"] <= 1e-6, result


@pytest.mark.parametrize("stage", [1, 3])
def test_export_gives_whole_expert_tensors_that_from_pretrained_loads(
    pools: Any, tmp_path: Path, stage: int
) -> None:
    results = pools(2).run(export_case, stage, str(tmp_path / f"export{stage}"))
    for result in results:
        assert result["expert_shapes"] == [8], result  # every expert, not this rank's 4
        assert result["worst"] <= 1e-5, result


def test_what_does_not_compose_is_refused_naming_the_fix_on_every_rank(pools: Any) -> None:
    results = pools(2).run(refused_cases)
    assert results[0] == results[1]
    refused = results[0]
    assert "autoep_size 3 does not divide the 2 ranks that read different tokens" in refused["size"]
    assert (
        "expert_parallel.autoep_size 2 with zero_optimization.offload_optimizer"
        in (refused["offload"])
    )
    assert "preset_model 'mixtral' is DeepSpeed's preset for mixtral models" in refused["preset"]
    assert "expert_parallel.top_k" in refused["routing"]
    assert (
        "sequence_parallel_size 2 with output_router_logits=True" in (refused["aux_with_sequence"])
    )


def test_the_hf_trainer_with_experts_split_matches_its_single_process_run(
    pools: Any, tmp_path: Path
) -> None:
    """ZeroDPTrainer (stage 3, E=2, accumulation 2, clipping) on 2 ranks against transformers'
    Trainer in one process on the same batches: the whole weights (every expert gathered
    back), each step's loss and grad norm. (Without the auxiliary loss: one process on the
    two ranks' rows at once computes it over both, a rank over its own; run_case checks it
    per micro-batch.)"""
    got = pools(2).run(trainer_with_experts, str(tmp_path / "zerodp"))[0]
    expected, logs = plain_trainer_run(str(tmp_path / "plain"), 2)
    assert got["steps"] == len(logs) == 3
    for name, value in expected.items():
        torch.testing.assert_close(got["weights"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    for mine, theirs in zip(got["logs"], logs, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6), (mine, theirs)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), (mine, theirs)


def moe_example() -> dict[str, float]:
    from examples import train_moe

    return train_moe.main(["--steps", "2"])


def test_the_moe_example_runs_and_matches_one_process(pools: Any) -> None:
    for result in pools(2).run(moe_example):
        assert result["worst"] <= 1e-5, result


def test_trls_sft_trainer_with_experts_split_matches_single_process_trl(
    pools: Any, tmp_path: Path
) -> None:
    """`with_zerodp(trl.SFTTrainer)` at stage 3 with E=2 on 2 ranks against TRL's own
    SFTTrainer in one process on the same batches (fp32; the auxiliary loss off, see
    `sft_trainer`)."""
    pytest.importorskip("trl")
    got = pools(2).run(sft_with_experts, str(tmp_path / "zerodp"), 2)[0]
    expected, losses = sft_single_process(str(tmp_path / "plain"), 2)
    for name, value in expected.items():
        torch.testing.assert_close(got["weights"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert got["losses"] == pytest.approx(losses, rel=1e-6), (got["losses"], losses)


def test_a_window_and_a_boundary_resume_at_another_e(pools: Any, tmp_path: Path) -> None:
    """Inside an accumulation window (SGD, stages that keep each rank's local sums: a window's
    sums of each saved EP rank's experts combined as the saved dims say, then this rank's
    experts cut from the whole): E=2 -> E=1 at stage 3, E=2 -> E=2 in the same layout (the
    sums as saved), E=1 -> E=2 at stage 2; shard groups' averages of whole tensors
    (`mics_shard_size` 1 on 2 ranks: two replicas, E=1) averaged, then cut, at E=2; and at a
    boundary E=1 -> E=2."""
    loads = [
        (Case(0, expert=2, gas=2), [Case(3, expert=1, gas=2), Case(0, gas=2)]),
        (Case(1, expert=1, gas=2), [Case(2, gas=2)]),
        (Case(2, expert=1, gas=2, shard=1), [Case(2, gas=2), Case(1, gas=2)]),
    ]
    for index, (saved, targets) in enumerate(loads):
        directory = str(tmp_path / f"window{index}")
        pools(2).run(save_inside_window, saved, 1, directory)
        for case in targets:
            for result in pools(2).run(resume_inside_window, saved, 2, 1, case, directory):
                assert result["weights"] <= 1e-5, (saved, case, result)
    saved = Case(1, expert=1, optimizer="adamw")
    directory = str(tmp_path / "boundary")
    pools(2).run(save_after, saved, 2, directory)
    for result in pools(2).run(resume, saved, 2, 2, Case(3, optimizer="adamw"), directory):
        assert result["loaded"] <= 1e-6, result
