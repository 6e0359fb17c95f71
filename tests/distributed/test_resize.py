"""A run resumed at another world size is the same run: the same global batch (the
accumulation follows the data ranks), the same samples in the same order, the same weights.

A restartable script (`resumable_training.train_resumable`: load at the start, save every
step, the loader from initialize, train_batch_size 4, micro-batch 1, 18 samples so the
epochs end padded) runs to step 5 on one world size and to step 10 on the other; its
weights must equal the uninterrupted run's, computed here in one process with the torch
optimizer on the global order written out in the test (`reference_weights`).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.resumable_training import reference_weights, train_resumable

CASES = [("adamw", 2), ("sgd", 3)]  # SGD with momentum at stage 3, AdamW at stage 2


def _max_difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("optimizer", "stage"), CASES)
def test_resume_at_another_world_size_is_the_uninterrupted_run(
    pools, tmp_path, optimizer: str, stage: int
) -> None:
    want = reference_weights(10, optimizer)
    for first, second in ((2, 1), (1, 2)):
        ckpt = str(tmp_path / f"{first}to{second}")
        # Saving every 5 steps here (every step costs time, not coverage: test_elastic does)
        before = pools(first).run(train_resumable, ckpt, 5, optimizer, stage, save_every=5)
        after = pools(second).run(train_resumable, ckpt, 10, optimizer, stage, save_every=5)
        # The first start finds nothing to load: (None, None) and a warning saying so.
        assert before[0]["loaded"] is None and before[0]["client_state"] is None
        assert any("no checkpoint to load" in line for line in before[0]["load_log"])
        for result in after:
            assert result["loaded"].endswith("global_step5") and result["start"] == 5
            # train_batch_size 4 = micro-batch 1 x accumulation x data ranks
            assert result["accumulation"] == 4 // second
            difference = _max_difference(result["weights"], want)
            assert difference < 1e-6, (first, second, difference)
        assert _max_difference(before[0]["weights"], reference_weights(5, optimizer)) < 1e-6
