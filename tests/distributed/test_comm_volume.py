"""Bytes moved per training step, per collective kind, against the ZeRO paper's figures.

Psi counts the elements of the model's (padded) flat groups. Per step:
stage 0 all-reduces Psi; stages 1 and 2 reduce-scatter Psi and all-gather Psi; stage 3
all-gathers its sharded parameters twice (forward, backward), reduce-scatters Psi, and
all-gathers its persistent (small, always gathered) parameters once after the step.
A 4-byte all-reduce of the gradient norm's square is the only extra traffic.

With prefetching on, stage 3 keeps the groups its backward starts with (up to the prefetch
window) gathered from the end of the forward, instead of releasing and gathering them again,
so it moves less than twice its sharded parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.models import TinyGPT, TinyGPTConfig
from zerodp.comm import CollectiveKind


def step_bytes(stage: int, prefetch: int = 0) -> dict[str, int]:
    torch.manual_seed(0)
    cfg = TinyGPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
    model = TinyGPT(cfg)  # input and output embeddings tied: one group, used twice per pass
    config = zerodp_config(
        stage,
        micro_batch=2,
        optimizer=optimizer_config("AdamW", lr=1e-3),
        persistence_threshold=100,
        zero={"reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": prefetch},
    )
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(dist.get_rank())

    def one_step() -> None:
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=generator)
        engine.backward(engine.module.loss(tokens[:, :-1], tokens[:, 1:]))
        engine.step()

    one_step()  # the first step records the order that later steps prefetch and reuse by
    engine.comm.stats.reset()
    one_step()
    stats = engine.comm.stats
    sharded = [s.flat for s in engine.groups if not s.persistent]
    resident = [s.flat for s in engine.groups if s.persistent]
    measured = {
        "all_reduce": stats.bytes[CollectiveKind.ALL_REDUCE],
        "reduce_scatter": stats.bytes[CollectiveKind.REDUCE_SCATTER],
        "all_gather": stats.bytes[CollectiveKind.ALL_GATHER],
        "psi": sum(g.padded_numel * g.full.element_size() for g in (s.flat for s in engine.groups)),
        "sharded": sum(g.padded_numel * g.full.element_size() for g in sharded),
        "resident": sum(g.padded_numel * g.full.element_size() for g in resident),
    }
    engine.destroy()
    return measured


NORM = 4  # the all-reduced square of the gradient norm (sharded stages)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_step_follow_the_zero_paper(pools, stage: int) -> None:
    m = pools(2).run(step_bytes, stage)[0]
    psi = m["psi"]
    if stage == 0:
        assert m == {**m, "all_reduce": psi, "reduce_scatter": 0, "all_gather": 0}
    elif stage in (1, 2):
        assert (m["all_reduce"], m["reduce_scatter"], m["all_gather"]) == (NORM, psi, psi)
    else:
        assert m["all_reduce"] == NORM
        assert m["reduce_scatter"] == psi
        assert m["all_gather"] == 2 * m["sharded"] + m["resident"], m
        assert m["sharded"] > 0.9 * psi  # most of the model is sharded here


def test_stage3_keeps_what_its_backward_starts_with(pools) -> None:
    exact = pools(2).run(step_bytes, 3, 0)[0]
    window = 4096  # elements: the tied embedding (64 x 32 = 2048) and a little more
    kept = pools(2).run(step_bytes, 3, window)[0]
    assert kept["reduce_scatter"] == exact["reduce_scatter"]
    saved = exact["all_gather"] - kept["all_gather"]
    assert 2048 * 4 <= saved <= (window + 2048) * 4, (exact, kept)
