"""Tiled compute (`"tiled_compute"`) against one process running the untiled model.

Each case trains the tiny Llama of `tests/sequence_setup.py` (2 layers, hidden 32,
intermediate 64, vocabulary 96) for 3 steps with its MLPs and its logits and loss
computed 3 tokens at a time, and compares with a plain copy of the model, untiled, on
the whole sequences in the same process: the returned loss of every micro-batch (and
that `.logits` is None: the logits were never built whole), the grad norm of every step,
every full parameter after every step (fp32 within 1e-5).

With sequence parallelism (S = 2, each rank's 7-token slice in tiles of 3, 3 and 1) at
stages 0-3, with accumulation, SGD and AdamW, clipping that triggers, a masked prompt,
padding, packed sequences and gradient checkpointing; without it (S = 1, D = 2) at stages
2 and 3 with data ranks whose sequences differ in length (13 and 5 tokens: 5 tiles on one
rank, 2 on the other), which must neither hang stage 3 nor change the result; at stage 3
with a group per module and none kept for reuse, where a gather once per tile would show
(it does, as a divergence error, when the tiles run with the inner modules' hooks in).
The MLPs alone and the loss alone: `tests/unit/test_tiled_compute.py`.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.sequence_setup import Case, run_cases

pytest.importorskip("transformers")

TILES = {"mlp": True, "logits_loss": True, "tile_tokens": 3}
# One stage 3 group per module, none kept for reuse: a gather per module hook, so a hook that
# ran once per tile would gather a different number of times on the two ranks (caught as a
# divergence; it is what the tiles' `quiet` prevents).
PER_MODULE = {"stage3_units": "modules", "stage3_max_reuse_distance": 0}
CASES = [
    Case(0, optimizer="sgd", gas=2, padding=True, extra={"tiled_compute": TILES}),
    Case(1, clip=0.05, masked_prompt=True, extra={"tiled_compute": TILES}),
    Case(2, sequence=1, lengths=(5, 13), optimizer="sgd", extra={"tiled_compute": TILES}),
    Case(3, gas=2, clip=0.05, masked_prompt=True, extra={"tiled_compute": TILES}),
    Case(3, checkpointing=True, packed=True, extra={"tiled_compute": TILES}),
    Case(
        3, sequence=1, lengths=(13, 5), clip=0.05, zero=PER_MODULE, extra={"tiled_compute": TILES}
    ),
]


def test_tiled_compute_matches_the_untiled_model_in_one_process(pools: Any) -> None:
    results = pools(2).run(run_cases, CASES, timeout_s=400)
    for rank_results in results:
        for case, result in zip(CASES, rank_results, strict=True):
            lengths = case.lengths or (case.length,)
            own = lengths[result["rank"] // case.sequence % len(lengths)]
            assert result["layer_lengths"] == [-(-own // case.sequence)], (case, result)
    print("\n".join(f"{c}: {r}" for c, r in zip(CASES, results[0], strict=True)))
