"""Models whose ranks take different paths, with leaf modules: exact at every stage.

`tests.moe_models.MoELM` routes each rank's tokens to different experts (some get no token
on some ranks; one, its router bias pushed down, gets none anywhere), and `VisionLM` runs
its vision tower only on ranks whose batch has images. With the mixture-of-experts blocks
(or the embedder that holds the vision tower) marked as stage 3 leaves, every case trains
exactly like the data-parallel reference computed in the test (`tests.lockstep`: each
rank's local gradient, averaged by an explicit all_reduce, zeros where a rank's experts got
no token), with gradient checkpointing, with a retained graph's second backward, and with
prefetching off and ranks of very different batch sizes (where a rank that used every
expert would otherwise reduce them before the ranks that did not). Every case checks that
its data really took different paths on different ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.lockstep import Lockstep
from tests.moe_models import (
    Embedder,
    MoEBlock,
    MoEConfig,
    MoELM,
    VisionLM,
    lm_loss,
    moe_inputs,
    vision_inputs,
)

# SGD, not Adam: attention's key bias has a gradient of exactly zero in theory, and Adam
# would turn the rounding noise there (which differs with the order of summation) into
# full-size steps.
SGD = optimizer_config("SGD", lr=0.1, momentum=0.9)
DEAD_EXPERT = 5  # its router bias is pushed down: no rank routes a token to it


def _reference_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _moe_model(cfg: MoEConfig, checkpoint: str | None) -> MoELM:
    torch.manual_seed(0)
    model = MoELM(cfg, checkpoint=checkpoint)
    with torch.no_grad():
        for block in model.moe_blocks():
            if cfg.num_experts > DEAD_EXPERT:
                block.router.bias[DEAD_EXPERT] = -30.0
    return model


def _gather_counts(model: MoELM) -> list[list[list[int]]]:
    """[rank][block][expert] token counts of the last forward."""
    counts = torch.tensor([b.last_counts for b in model.moe_blocks()])
    everyone = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, counts)
    return [c.tolist() for c in everyone]


# variant: (checkpoint, pattern, MoEConfig overrides, batch per rank, zero_optimization extras)
MOE_VARIANTS = {
    "three_steps": (None, "steps", {}, None, {}),
    "checkpoint_nonreentrant": ("nonreentrant", "steps", {}, None, {}),
    "checkpoint_reentrant": ("reentrant", "steps", {}, None, {}),
    "retained_second_backward": (None, "seed", {}, None, {}),
    "uneven_batches_no_prefetch": (
        None,
        "steps",
        {"num_experts": 5, "top_k": 1},
        (6, 1, 1),
        {"stage3_prefetch_bucket_size": 0},
    ),
}


def moe_case(
    stage: int, variant: str, via_config: bool, units: bool = False
) -> list[list[list[list[int]]]]:
    """One variant in lockstep with the reference; returns the token counts of every step.

    `units`: every module that holds no leaf is gathered as a unit (`stage3_unit_numel`),
    so leaves sit among units.
    """
    checkpoint, pattern, overrides, batches, zero = MOE_VARIANTS[variant]
    if units:
        zero = {**zero, "stage3_unit_numel": 10**9}
    cfg = MoEConfig(**{"n_layer": 1, "num_experts": 6, **overrides})  # few collectives
    model = _moe_model(cfg, checkpoint)
    if via_config:
        zero = {**zero, "leaf_module": {"classes": ["MoEBlock"]}}
    else:
        assert zerodp.zero.set_z3_leaf_modules(model, [MoEBlock]) == model.moe_blocks()
    config = zerodp_config(stage, optimizer=SGD, persistence_threshold=0, zero=zero)
    run = Lockstep(model, config, _reference_sgd, label=f"stage {stage}, {variant}")
    assert zerodp.zero.get_z3_leaf_modules(model) == model.moe_blocks()
    rank = dist.get_rank()
    batch = batches[rank] if batches else 1
    counts = []
    steps = 1 if pattern == "seed" else 2
    for step in range(steps):
        tokens = moe_inputs(rank, step, cfg, batch=batch)
        out, ref = run.forward(tokens)
        counts.append(_gather_counts(model))
        if pattern == "seed":  # forward; zero_grad; backward(retain); zero_grad; backward
            run.zero_grad()
            run.backward((lm_loss(out, tokens), lm_loss(ref, tokens)), retain_graph=True)
            run.check_all_released()
            run.zero_grad()
            run.backward((out.square().mean(), ref.square().mean()))
        else:
            run.backward((lm_loss(out, tokens), lm_loss(ref, tokens)))
        run.step()
        run.check_all_released()
    assert run.grad_comparisons == (2 if pattern == "seed" else steps)
    assert run.param_comparisons == steps
    run.close()
    return counts


def moe_cases(stage: int) -> dict[str, list[list[list[list[int]]]]]:
    return {
        variant: moe_case(stage, variant, via_config=index % 2 == 1)
        for index, variant in enumerate(MOE_VARIANTS)
    }


def assert_paths_differ(variant: str, counts: list[list[list[list[int]]]]) -> None:
    """Some expert got tokens on one rank and none on another; the dead one got none anywhere;
    with uneven batches, one rank used every expert of a block where another did not."""
    diverged = every_expert_on_one_rank = False
    for step in counts:
        for block in range(len(step[0])):
            used = [[n > 0 for n in rank_counts[block]] for rank_counts in step]
            diverged |= any(len({u[e] for u in used}) > 1 for e in range(len(used[0])))
            every_expert_on_one_rank |= any(all(u) for u in used) and not all(map(all, used))
            if len(used[0]) > DEAD_EXPERT:
                assert not any(u[DEAD_EXPERT] for u in used), (variant, step)
    assert diverged, (variant, counts)
    if variant == "uneven_batches_no_prefetch":
        assert every_expert_on_one_rank, counts


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_moe_with_leaf_blocks_matches_reference(pools, stage: int, world_size: int) -> None:
    results = pools(world_size).run(moe_cases, stage, timeout_s=300)
    for variant, counts in results[0].items():
        assert_paths_differ(variant, counts)


def moe_cases_with_units() -> dict[str, list[list[list[list[int]]]]]:
    return {
        variant: moe_case(3, variant, via_config=index % 2 == 1, units=True)
        for index, variant in enumerate(MOE_VARIANTS)
    }


def test_moe_leaves_among_units_match_reference(pools) -> None:
    results = pools(2).run(moe_cases_with_units, timeout_s=300)
    for variant, counts in results[0].items():
        assert_paths_differ(variant, counts)


# -- a branch only some ranks take -------------------------------------------------------------


def vision_case(stage: int) -> list[bool]:
    torch.manual_seed(0)
    model = VisionLM()
    zerodp.zero.set_z3_leaf_modules(model, ["Embedder"])
    config = zerodp_config(stage, optimizer=SGD, persistence_threshold=0)
    run = Lockstep(model, config, _reference_sgd, label=f"vision, stage {stage}")
    rank = dist.get_rank()
    ran = []
    for step in range(3):
        tokens, images = vision_inputs(rank, step, with_images=(rank + step) % 2 == 0)
        out, ref = run.forward(tokens, images)
        ran.append(model.embed.ran_vision)
        run.backward((lm_loss(out, tokens), lm_loss(ref, tokens)))
        run.step()
        run.check_all_released()
    run.close()
    return ran


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_branch_on_some_ranks_with_leaf_matches_reference(pools, stage, world_size) -> None:
    ran = pools(world_size).run(vision_case, stage)
    assert all(len({r[step] for r in ran}) == 2 for step in range(3)), ran


# -- the working set --------------------------------------------------------------------------


def leaf_working_set() -> dict[str, int]:
    """Gathered elements at their peak in a stage 3 step with leaves, without prefetch or reuse."""
    cfg = MoEConfig(d_model=32, d_expert=64)
    model = _moe_model(cfg, None)
    zerodp.zero.set_z3_leaf_modules(model, [MoEBlock])
    zero = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
    config = zerodp_config(3, optimizer=SGD, persistence_threshold=0, zero=zero)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    gatherer = engine.params.gatherer
    sizes = {
        id(block): sum(s.gather.numel for s in engine.params.module_groups.gathered_for(block))
        for block in model.moe_blocks()
    }
    model_numel = sum(s.gather.numel for s in gatherer.states)
    rank = dist.get_rank()
    tokens = moe_inputs(rank, 0, cfg)
    engine.backward(lm_loss(engine(tokens), tokens))  # the first step records the order
    engine.step()
    gatherer.reset_peak()
    tokens = moe_inputs(rank, 1, cfg)
    engine.backward(lm_loss(engine(tokens), tokens))
    peak = gatherer.peak_live_numel
    engine.step()
    engine.destroy()
    return {"peak": peak, "largest_leaf": max(sizes.values()), "model": model_numel}


def test_leaf_working_set_is_the_largest_leaf(pools) -> None:
    for sizes in pools(2).run(leaf_working_set):
        assert sizes["peak"] == sizes["largest_leaf"], sizes
        assert sizes["largest_leaf"] < sizes["model"] / 2, sizes


# -- marking --------------------------------------------------------------------------------


def test_marking_and_unmarking() -> None:
    model = MoELM(MoEConfig())
    assert zerodp.zero.set_z3_leaf_modules(model, ["MoEBlock"]) == model.moe_blocks()
    assert all(zerodp.zero.z3_leaf_module(b) for b in model.moe_blocks())
    assert not zerodp.zero.z3_leaf_module(model.blocks[0])
    assert zerodp.zero.unset_z3_leaf_modules(model, [MoEBlock]) == model.moe_blocks()
    assert zerodp.zero.get_z3_leaf_modules(model) == []
    with pytest.raises(zerodp.UsageError, match="MoETransformerBlock"):
        zerodp.zero.set_z3_leaf_modules(model, [Embedder])
    assert zerodp.zero.set_z3_leaf_modules(model, [Embedder], raise_if_not_found=False) == []


def test_config_entries_match_names_suffixes_and_classes() -> None:
    from zerodp.stage3.leaf import mark_from_config

    model = MoELM(MoEConfig())
    found = mark_from_config(model, [], ["blocks.*.moe"], [])
    assert found == model.moe_blocks()
    zerodp.zero.unset_z3_leaf_modules(model, [MoEBlock])
    assert mark_from_config(model, [], [], [".moe"]) == model.moe_blocks()
    zerodp.zero.unset_z3_leaf_modules(model, [MoEBlock])
    assert mark_from_config(model, ["tests.moe_models.MoEBlock"], [], []) == model.moe_blocks()
    zerodp.zero.unset_z3_leaf_modules(model, [MoEBlock])
    unmatched = r"names entry 'blocks\.\*\.mlp' matches no module"
    with pytest.raises(zerodp.ConfigError, match=unmatched):
        mark_from_config(model, [], ["blocks.*.mlp"], [])
