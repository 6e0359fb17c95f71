"""Sequence parallelism (Ulysses) with ZeRO 0-3 against one process on the whole sequences.

Every training case (`tests/sequence_setup.py`) runs the tiny Llama (sdpa, 4 query heads, 2
key/value heads) with a user's plain loop (`engine(input_ids=..., labels=...)`,
`engine.backward(out.loss)`, `engine.step()`) for 3 steps and compares, against a plain copy of
the model computing every replica's micro-batches on the whole 13-token sequences in the
same process: the returned loss of every micro-batch, the global grad norm of every step (before
clipping; clipping at 0.05 triggers: the norms are near 1), every full parameter after every
step (fp32 within 1e-5), and the sequence length every decoder layer saw (ceil(13 / S)).

World size 2 (S = 2): stages 0-3 with accumulation 1 and 2, AdamW and SGD, clipping; a masked
prompt leaving the first slice without a target; a padded row (attention mask); packed
sequences (positions restarting in a row); the eager attention function with its float mask;
transformers' gradient checkpointing at stage 3;
Muon (whole matrices exchanged to their owners); bf16 and fp16 (against the same recipe in one
process); optimizer offload. A model zerodp does not switch (its attention wrapped with
`zerodp.sequence.sequence_parallel_attention`, the loop splitting its own inputs). Misuse:
`engine.join()`, ranks of a group handed different batches, a forward without labels under
autograd, a 4D mask, a model whose attention bypasses transformers' interface, heads S does not
divide: each an error on every rank, and the engine trains exactly afterwards; generation and a
label-free forward under no_grad run whole and equal one process. The all-to-all bytes of a
step against their closed form.

World size 4: S = 2 x D = 2 (two replicas, each rank's batch that of its data rank) and S = 4
(more ranks than key/value heads: each key/value head repeated; eager and sdpa, with a padding
or packing mask, so both expand the key/value heads by the local ratio); the engine's loader gives a
sequence group the same samples and the replicas different ones; a checkpoint saved at
(S = 2, D = 1) resumes at (S = 1, D = 2), (S = 2, D = 1) at stage 3 and (S = 2, D = 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.sequence_setup import (
    Case,
    attention_bytes,
    loader_samples,
    misuse,
    refused_at_initialize,
    resume,
    resume_inside_window,
    run_cases,
    save_after,
    save_inside_window,
    wrapped_attention_case,
)

pytest.importorskip("transformers")

WORLD_2 = [
    Case(0, optimizer="sgd"),
    Case(0, gas=2, clip=0.05, padding=True),
    Case(1, optimizer="sgd", gas=2, masked_prompt=True),
    Case(1, clip=0.05, packed=True),
    Case(2, gas=2, clip=0.05, masked_prompt=True),
    Case(2, optimizer="muon", clip=0.05),
    Case(2, zero={"offload_optimizer": {"device": "cpu"}}, clip=0.05),
    Case(3, optimizer="sgd", zero={"offload_param": {"device": "cpu"}}),
    Case(3, optimizer="sgd", zero_init=True),
    Case(3, optimizer="sgd", clip=0.05, padding=True),
    Case(2, optimizer="sgd", attention="eager", padding=True, masked_prompt=True),
    Case(3, gas=2, checkpointing=True, masked_prompt=True, packed=True),
    Case(1, optimizer="sgd", dtype="bf16"),
    Case(3, optimizer="sgd", dtype="fp16", gas=2),
]
WORLD_4 = [
    Case(1, gas=2, clip=0.05, masked_prompt=True, monitor=True),
    Case(3, optimizer="sgd", padding=True),
    Case(2, sequence=4, clip=0.05, masked_prompt=True, attention="eager", padding=True),
    Case(0, sequence=4, gas=2, optimizer="sgd", packed=True),
    # Sequence x tensor parallelism (S = 2 x T = 2, one data rank): Ulysses over each tensor
    # slice's heads, with tiling, clipping and accumulation.
    Case(
        3,
        gas=2,
        clip=0.05,
        masked_prompt=True,
        monitor=True,
        extra={"tensor_parallel": {"autotp_size": 2}},
    ),
    Case(2, gas=2, clip=0.05, extra={"tensor_parallel": {"autotp_size": 2}}),
    Case(0, optimizer="sgd", packed=True, extra={"tensor_parallel": {"autotp_size": 2}}),
    Case(
        1,
        optimizer="sgd",
        padding=True,
        extra={
            "tensor_parallel": {"autotp_size": 2},
            "tiled_compute": {"mlp": True, "logits_loss": True, "tile_tokens": 4},
        },
    ),
]


def check_results(cases: list[Case], results: list[list[dict[str, Any]]]) -> None:
    for rank_results in results:
        for case, result in zip(cases, rank_results, strict=True):
            local = -(-case.length // case.sequence)
            tensor = case.extra.get("tensor_parallel", {}).get("autotp_size", 1)
            assert result["layer_lengths"] == [local], (case, result)
            # rank = (d * S + s) * T + t: the sequence rank is the middle coordinate.
            sequence_rank = (result["rank"] // tensor) % case.sequence
            assert result["sequence_rank"] == sequence_rank, (case, result)
            world = len(results)
            assert result["data_parallel_size"] == world // (case.sequence * tensor), result
            assert result["dp_world_size"] == result["data_parallel_size"], result
            # rank = (d * S + s) * T + t: the data rank is the outer coordinate.
            data_rank = result["rank"] // (case.sequence * tensor)
            assert result["data_parallel_ranks"] == (data_rank, data_rank), (case, result)
            if case.monitor and result["rank"] == 0:
                assert "monitor" in result, (case, result)  # checked in train_and_compare
    print("\n".join(f"{c}: {r}" for c, r in zip(cases, results[0], strict=True)))


def test_world_2_matches_one_process(pools: Any) -> None:
    check_results(WORLD_2, pools(2).run(run_cases, WORLD_2, timeout_s=400))


def test_a_model_with_its_own_attention_wrapped(pools: Any) -> None:
    for stage in (1, 3):
        results = pools(2).run(wrapped_attention_case, stage)
        assert all(r["local_length"] == 7 for r in results), results


def test_misuse_is_refused_on_every_rank_and_training_goes_on_exactly(pools: Any) -> None:
    first, second = pools(2).run(misuse)
    assert first == second  # every rank raised the same errors
    assert (
        "sequence_parallel_size 2" in first["join"]
        and "set sequence_parallel_size" in first["join"]
    )
    assert "sequence ranks [1] differ" in first["different batches"]
    assert "pass labels=" in first["whole with gradients"]
    assert "pass the 2D padding mask" in first["4D mask"]
    assert "ran no attention through zerodp" in first["bypassed attention"]
    assert first["generate"] == "same"
    assert first["restored"] == "sdpa"  # destroy() pointed the config back
    heads = pools(2).run(refused_at_initialize, 3)
    assert all("does not divide the model's 3 attention heads" in h for h in heads), heads


def test_the_all_to_all_bytes_are_the_closed_form(pools: Any) -> None:
    for result in pools(2).run(attention_bytes):
        assert result["measured"] == result["expected"] > 0, result
        assert result["calls"] == result["expected_calls"], result


def test_world_4_matches_one_process_and_resumes_across_sizes(pools: Any, tmp_path: Path) -> None:
    check_results(WORLD_4, pools(4).run(run_cases, WORLD_4, timeout_s=400))
    firsts = pools(4).run(loader_samples, 2)
    assert firsts[0] == firsts[1] and firsts[2] == firsts[3], firsts  # a sequence group
    assert firsts[0] != firsts[2], firsts  # the two replicas
    saved = Case(2, gas=2, clip=0.05)
    directory = str(tmp_path / "saved")
    pools(2).run(save_after, saved, 2, directory)
    for world, case in (
        (2, Case(2, sequence=1, gas=2, clip=0.05)),
        (2, Case(3, gas=2, clip=0.05)),
        (4, Case(1, gas=2, clip=0.05)),
    ):
        results = pools(world).run(resume, saved, 1, 2, case, directory)
        expected_replicas = world // case.sequence
        assert all(r["data_parallel_size"] == expected_replicas for r in results), results


def test_a_checkpoint_inside_a_window_resumes_at_another_stage_and_layout(
    pools: Any, tmp_path: Path
) -> None:
    """S = 2, D = 1, saved after the window's first micro-batch at a stage that keeps each
    rank's local sums (0, 1): loaded at stages 2 and 3 (the sums combined as the boundary
    would: summed over the sequence ranks, divided by the data ranks), in the same layout
    (the sums as saved), at S = 1 x D = 2 and at S = 2 x D = 2 (SGD: a scale error in the
    combined sums moves the weights)."""
    loads = {
        0: [(2, Case(3, gas=2, optimizer="sgd")), (2, Case(0, gas=2, optimizer="sgd"))],
        1: [
            (2, Case(2, gas=2, optimizer="sgd")),
            (2, Case(3, sequence=1, gas=2, optimizer="sgd")),
            (4, Case(2, gas=2, optimizer="sgd")),
        ],
    }
    for saved_stage, targets in loads.items():
        saved = Case(saved_stage, gas=2, optimizer="sgd")
        directory = str(tmp_path / f"window{saved_stage}")
        pools(2).run(save_inside_window, saved, 1, directory)
        for world, case in targets:
            results = pools(world).run(resume_inside_window, saved, 1, 1, case, directory)
            assert all(r["weights"] <= 1e-5 for r in results), results


def long_sequence_example() -> dict[str, Any]:
    from examples import train_long_sequences

    args = ["--steps", "2", "--seq-len", "63", "--layers", "1", "--hidden", "32", "--heads", "4"]
    return train_long_sequences.main([*args, "--max-train-bytes", "65536"])


def test_the_long_sequence_example_runs(pools: Any) -> None:
    for summary in pools(2).run(long_sequence_example):
        assert summary["layer_lengths"] == [32], summary
        assert summary["last_loss"] < summary["first_loss"], summary
