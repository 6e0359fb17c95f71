"""The expert-parallel layer alone (no engine): tiny HF MoE models split over EP groups, exact.

Each rank splits a copy of the same model and feeds its own batch; the reference is
the unsplit model in the worker, run on every rank's batch (`tests.ep_layer_reference`).
fp32, 1e-5. World 2 at E=2: Qwen3-MoE and Mixtral (by their own plans and by module-name
patterns), OLMoE, gpt-oss and DeepSeek-V3, with each of transformers' CPU experts
implementations and with activation checkpointing; experts that no token reaches (on one
rank some of its experts, on another all of them) have exactly zero gradients; one
experts module fed the model's masked slots, with the all-to-all bytes against their
closed form, and under a gradient penalty (double backward). World 4: E=4, and E=2 as
two EP groups. The cases take about 4 s on two cores once the workers have imported
transformers (process start and that import cost more when the pools are fresh).
"""

from __future__ import annotations

from typing import Any

from tests.ep_layer_reference import (
    double_backward,
    empty_batch_on_one_rank,
    parity,
    sentinel_and_bytes,
)
from tests.hf_moe_models import BUILDERS, EXPERT_LAYERS, HIDDEN, NUM_EXPERTS

BOUND = 1e-5
NUMERIC = (
    "logits",
    "loss",
    "aux",
    "input_grad",
    "ordinary_grads",
    "expert_grads",
    "expert_data_grads",
)


def two_rank_cases() -> dict[str, Any]:
    pair = [[0, 1]]
    cases: dict[str, Any] = {name: parity(name, 2, pair) for name in BUILDERS}
    for name in ("qwen3_moe", "mixtral"):
        cases[f"{name} by patterns"] = parity(
            name, 2, pair, patterns=["model.layers.*.mlp.experts"]
        )
        # Experts 6 and 7 idle: rank 1 still runs 4 and 5. Experts 4-7 idle: rank 1 gets no row.
        for pairs in (3, 2):
            cases[f"{name} idle {pairs}"] = parity(name, 2, pair, idle_pairs=pairs)
    cases["qwen3_moe checkpointed"] = parity("qwen3_moe", 2, pair, checkpointed=True)
    cases["qwen3_moe batched_mm"] = parity("qwen3_moe", 2, pair, implementation="batched_mm")
    # The model's eager loop reads only the experts it routes to: on a rank that receives no
    # row, the expert tensors get their (zero) gradients from the layer alone.
    for pairs in (3, 2):
        cases[f"qwen3_moe idle {pairs}, eager"] = parity(
            "qwen3_moe", 2, pair, idle_pairs=pairs, implementation="eager"
        )
    return cases


def check_parity(case: str, result: dict[str, Any], local_experts: int, layers: int) -> None:
    for key in NUMERIC:
        if key in result:
            assert result[key] <= BOUND, (case, key, result[key])
    assert result["num_expert_tensors"] >= 2 * layers, (case, result)
    # While it ran, every experts module held (and said it held) E-th of the experts.
    assert result["held"] == [(local_experts, local_experts)], (case, result["held"])
    assert result["names_kept"], case
    assert result["whole_equal"], case
    assert all(c.startswith("ExpertParallel") for c in result["classes"]), case
    assert result["chosen_idle"] == [], (case, result["chosen_idle"])
    assert result["idle_grads_zero"], case


def test_two_ranks_match_one_process(pools) -> None:
    results = pools(2).run(two_rank_cases, timeout_s=300)
    for rank, cases in enumerate(results):
        for case, result in cases.items():
            name = case.split()[0]
            check_parity(f"rank {rank}: {case}", result, NUM_EXPERTS // 2, len(EXPERT_LAYERS[name]))
            if name in ("qwen3_moe", "mixtral", "olmoe", "gpt_oss"):
                assert "aux" in result, case  # the load-balancing loss was compared


def test_masked_slots_and_all_to_all_bytes(pools) -> None:
    """Slots the model masks contribute nothing and their weights get zero gradients; the
    all-to-alls are counted in the comm stats: counts, then rows out and back, forward and
    backward (five calls)."""
    results = pools(2).run(sentinel_and_bytes, "eager")
    for rank, result in enumerate(results):
        for key in ("out", "hidden_grad", "weights_grad", "expert_grads"):
            assert result[key] <= BOUND, (rank, key, result)
        assert result["masked_weights_grad"] == 0.0, result
        assert result["calls"] == 5, result
        assert result["bytes"] == result["expected_bytes"], result


def test_a_gradient_penalty_differentiates_through_the_exchanges(pools) -> None:
    for rank, result in enumerate(pools(2).run(double_backward)):
        assert result["expert_grad_size"] > 1e-5, result  # the second order reaches the experts
        for key in ("hidden_grad", "weights_grad", "expert_grads"):  # relative differences
            assert result[key] <= BOUND, (rank, key, result)


def test_a_rank_without_tokens_still_serves_its_experts(pools) -> None:
    results = pools(2).run(empty_batch_on_one_rank)
    assert [r["shape"] for r in results] == [(6, HIDDEN), (0, HIDDEN)]
    for rank, result in enumerate(results):
        for key in ("out", "hidden_grad", "expert_grads"):
            assert result[key] <= BOUND, (rank, key, result)


def four_rank_cases() -> dict[str, Any]:
    return {
        "E=4": parity("qwen3_moe", 4, [[0, 1, 2, 3]]),
        "E=2 x 2 groups": parity("qwen3_moe", 2, [[0, 1], [2, 3]]),
        "E=2 x 2 groups, experts idle": parity("mixtral", 2, [[0, 1], [2, 3]], idle_pairs=2),
    }


def test_four_ranks_at_e4_and_two_groups_of_e2(pools) -> None:
    results = pools(4).run(four_rank_cases, timeout_s=300)
    for rank, cases in enumerate(results):
        for case, result in cases.items():
            local = NUM_EXPERTS // (4 if case == "E=4" else 2)
            check_parity(f"rank {rank}: {case}", result, local, 2)
