"""Stage 3 specifics: model structures, parameter status, Init, GatheredParameters, prefetch.

The parity matrix (test_parity_matrix.py) already runs stage 3 through the same scenarios as
stages 0-2; here are the structures and features only stage 3 has to get right. Training is
compared with the data-parallel reference (`ReferenceDP`); a build under `Init` with a
normal build of the same model (`tests.models.TinyGPT`, embeddings tied).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerodp
from tests.configs import optimizer_config, zerodp_config
from tests.lockstep import assert_all_released
from tests.models import (
    FunctionalTiedLM,
    SharedBlockNet,
    TiedLM,
    TinyGPT,
    TinyGPTConfig,
    TinyNet,
    shared_block_inputs,
    tiny_inputs,
    token_inputs,
)
from zerodp.monitor import ideal_model_state_bytes
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import FP32_TOLERANCE, assert_grads_match, assert_params_match
from zerodp.zero import GatheredParameters, Init, ParamStatus, param_status

STRUCTURES = {
    "tied_embeddings": (TiedLM, token_inputs),
    "parent_uses_child_weight": (FunctionalTiedLM, token_inputs),
    "shared_block_nested_containers": (SharedBlockNet, shared_block_inputs),
}


ADAMW = optimizer_config("AdamW", lr=1e-2, weight_decay=0.01)


def _reference_adamw(params: Any) -> torch.optim.Optimizer:
    """The config's AdamW: torch's, with the fused kernel zerodp takes by default."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=True)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def structure_parity(
    structure: str,
    threshold: int,
    steps: int = 3,
    zero: dict[str, int] | None = None,
    units: tuple[str, ...] = (),
) -> int:
    """Train `structure` against the reference; returns how many groups the engine laid out.

    `units`: the modules that must have formed stage 3 units (checked before training).
    """
    model_class, inputs = STRUCTURES[structure]
    torch.manual_seed(0)
    model = model_class()
    ref_model = copy.deepcopy(model)
    config = zerodp_config(3, optimizer=ADAMW, persistence_threshold=threshold, zero=zero)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    if units:
        _assert_units_formed(model, engine, units)
    num_groups = len(engine.groups)
    reference = ReferenceDP(ref_model, _reference_adamw)
    rank = dist.get_rank()
    for step in range(steps):
        x = inputs(rank, step)
        if step == 0:  # each rank its own data: identical data would hide a missing reduction
            gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, x)
            assert not any(torch.equal(gathered[0], other) for other in gathered[1:]), structure
        engine.backward(_loss(engine(x)))
        reference.run_backward(lambda x=x: _loss(ref_model(x)).backward())
        assert_grads_match(model, reference, f"{structure}, threshold {threshold}, step {step}")
        engine.step()
        reference.step()
        reference.zero_grad()
        assert_all_released(model, 3)  # after step(): nothing gathered, nothing in flight
        assert_params_match(model, reference, f"{structure}, after step {step}")
    engine.destroy()
    return num_groups


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("threshold", [0, 1_000_000], ids=["threshold_0", "threshold_large"])
@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_structures_match_reference(pools, structure: str, threshold: int, world_size: int):
    pools(world_size).run(structure_parity, structure, threshold)


# -- units (stage3_unit_numel) ----------------------------------------------------------------


def gpt_tokens(rank: int, step: int, cfg: TinyGPTConfig) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(cfg.vocab_size, (3, cfg.seq_len), generator=gen)


# With no size limit every outermost module below the root that runs a forward is a unit
# (containers, which are never called, are not): named here, in registration order.
UNITS_AT_ANY_SIZE = {
    "tied_embeddings": ("embed", "body", "head"),
    "parent_uses_child_weight": ("embed", "body"),
    "shared_block_nested_containers": (
        "inp",
        "shared",
        "stack.0.a",
        "stack.0.b",
        "stack.1.a",
        "stack.1.b",
        "out",
    ),
}


def _assert_units_formed(model: nn.Module, engine: zerodp.ZeroEngine, units: tuple[str, ...]):
    """Each named unit gathers the groups of its whole subtree; the parameters it registers
    first (a tied weight belongs to the unit that registers it first) are one group holding
    exactly them; no module inside a unit owns a group of its own."""
    modules = dict(model.named_modules())
    module_groups = engine.params.module_groups
    index = engine.groups
    seen: set[int] = set()
    for name in units:
        unit = modules[name]
        holding = {id(index.state_of(p)) for p in unit.parameters()}
        gathered = {id(s) for s in module_groups.gathered_for(unit)}
        assert gathered == holding, (name, module_groups.gathered_for(unit))
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen |= {id(p) for p in own}
        if own:
            groups = {id(index.state_of(p)): index.state_of(p) for p in own}
            assert len(groups) == 1, (name, list(groups.values()))
            (group,) = groups.values()
            assert group is not None and {id(p) for p in group.params} == {id(p) for p in own}
        for inner_name, inner in unit.named_modules(prefix=name):
            if inner is not unit:
                assert not module_groups.owns_any(inner), (name, inner_name)
    assert seen == {id(p) for p in model.parameters()}, "a parameter outside every unit"


def group_count(structure: str) -> int:
    """How many groups `structure` is laid out in without units (threshold 0)."""
    torch.manual_seed(0)
    config = zerodp_config(
        3, optimizer=ADAMW, persistence_threshold=0, zero={"stage3_units": "modules"}
    )
    engine, _, _, _ = zerodp.initialize(model=STRUCTURES[structure][0](), config=config)
    count = len(engine.groups)
    engine.destroy()
    return count


def _train_beside_reference(
    engine: zerodp.ZeroEngine, model: TinyGPT, ref_model: TinyGPT, cfg: Any, label: str
) -> None:
    """Three steps on the engine and on the data-parallel reference: every gradient after each
    backward and every weight after each step compared, every sharded group released."""
    reference = ReferenceDP(ref_model, _reference_adamw)
    for step in range(3):
        x = gpt_tokens(dist.get_rank(), step, cfg)
        engine.backward(_loss(engine(x)))
        reference.run_backward(lambda x=x, m=ref_model: _loss(m(x)).backward())
        assert_grads_match(model, reference, f"{label}, step {step}")
        engine.step()
        reference.step()
        reference.zero_grad()
        assert_all_released(model, 3)
        assert_params_match(model, reference, f"{label}, after step {step}")
    engine.destroy()


def units_match_reference() -> None:
    """Units change how parameters are grouped and gathered, never what training computes."""
    counts = {}
    for structure in STRUCTURES:  # every module below the root with a forward: one unit
        units = UNITS_AT_ANY_SIZE[structure]
        with_units = structure_parity(structure, 0, zero={"stage3_unit_numel": 10**9}, units=units)
        counts[structure] = (with_units, group_count(structure))
    # Units merge groups, never split them; TiedLM's body (two Linears) is one group only
    # with units, so units on cannot silently be the same layout as units off.
    assert all(on <= off for on, off in counts.values()), counts
    assert counts["tied_embeddings"][0] < counts["tied_embeddings"][1], counts
    cfg = _gpt_config()
    block_numel = sum(p.numel() for p in TinyGPT(cfg).blocks[0].parameters())
    for prefetch in (0, 10**9):  # released and gathered again in backward; kept throughout
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        ref_model = copy.deepcopy(model)
        zero = {"stage3_unit_numel": block_numel, "stage3_prefetch_bucket_size": prefetch}
        config = zerodp_config(3, optimizer=ADAMW, persistence_threshold=0, zero=zero)
        engine, _, _, _ = zerodp.initialize(model=model, config=config)
        index = engine.params.index
        block_groups = []
        for block in model.blocks:  # each block is one unit: one group for all its parameters
            states = {id(index.state_of(p)) for p in block.parameters()}
            assert len(states) == 1, (prefetch, len(states))
            block_groups += states
        assert len(set(block_groups)) == cfg.n_layer
        _train_beside_reference(engine, model, ref_model, cfg, f"units, prefetch {prefetch}")


def test_units_match_reference(pools) -> None:
    pools(2).run(units_match_reference)


# -- the default units: one per repeated block (stage3_units "blocks") -------------------------


def _groups_per_block(engine: zerodp.ZeroEngine, model: TinyGPT) -> list[int]:
    """How many sharded groups each block's parameters live in."""
    index = engine.params.index
    counts = []
    for block in model.blocks:
        states = [index.state_of(p) for p in block.parameters()]
        counts.append(len({id(s) for s in states if s is not None and not s.flat.persistent}))
    return counts


def default_units_match_reference() -> dict[str, list[int]]:
    """With the default config each GPT block is one unit (one sharded group, gathered at the
    block's boundary, nothing inside it hooked), training stays exact against the
    data-parallel reference; a block over `stage3_max_live_parameters` or
    `stage3_prefetch_bucket_size` falls back to one group per module, and
    `stage3_units: "modules"` asks for that everywhere."""
    cfg = _gpt_config()
    block_numel = sum(p.numel() for p in TinyGPT(cfg).blocks[0].parameters())
    cases: dict[str, tuple[int, dict[str, Any]]] = {
        "default, threshold 0": (0, {}),
        "default, threshold 100": (100, {}),  # biases and norms persistent, weights in the unit
        "oversize block": (0, {"stage3_max_live_parameters": block_numel - 1}),
        "block over the prefetch bucket": (0, {"stage3_prefetch_bucket_size": block_numel - 1}),
        "modules": (0, {"stage3_units": "modules"}),
    }
    found = {}
    for label, (threshold, zero) in cases.items():
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        ref_model = copy.deepcopy(model)
        config = zerodp_config(3, optimizer=ADAMW, persistence_threshold=threshold, zero=zero)
        engine, _, _, _ = zerodp.initialize(model=model, config=config)
        module_groups = engine.params.module_groups
        found[label] = _groups_per_block(engine, model)
        blocks_are_units = [
            not any(module_groups.owns_any(m) for m in block.modules() if m is not block)
            for block in model.blocks
        ]
        found[label + ", units"] = [int(u) for u in blocks_are_units]
        _train_beside_reference(engine, model, ref_model, cfg, label)
    return found


def test_default_units_are_the_blocks_and_exact(pools) -> None:
    found = pools(2).run(default_units_match_reference)[0]
    n_layer = _gpt_config().n_layer
    assert found["default, threshold 0"] == [1] * n_layer, found
    assert found["default, threshold 0, units"] == [1] * n_layer, found
    assert found["default, threshold 100"] == [1] * n_layer, found
    assert found["default, threshold 100, units"] == [1] * n_layer, found
    for per_module in ("oversize block", "block over the prefetch bucket", "modules"):
        assert all(n > 1 for n in found[per_module]), (per_module, found)
        assert found[per_module + ", units"] == [0] * n_layer, (per_module, found)


# -- zero.Init -----------------------------------------------------------------------------


def _gpt_config() -> TinyGPTConfig:
    return TinyGPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def init_matches_normal_build() -> None:
    cfg = _gpt_config()
    torch.manual_seed(dist.get_rank())  # different seeds: Init must still agree with rank 0
    if dist.get_rank() == 0:
        torch.manual_seed(1234)
    with Init(config=zerodp_config(3, optimizer=ADAMW, persistence_threshold=0)):
        sharded = TinyGPT(cfg)
    torch.manual_seed(1234)
    normal = TinyGPT(cfg)
    assert all(param_status(p) is ParamStatus.NOT_AVAILABLE for p in sharded.parameters())
    with GatheredParameters(list(sharded.parameters())):
        for (name, p), q in zip(sharded.named_parameters(), normal.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=name)
    assert sharded.head.weight is sharded.tok_emb.weight


def test_init_matches_a_normal_build_with_the_same_seed(pools) -> None:
    pools(2).run(init_matches_normal_build)


def init_memory_and_training() -> dict[str, int]:
    cfg = TinyGPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=2, d_model=64)
    torch.manual_seed(0)
    reference_model = TinyGPT(cfg)
    config = zerodp_config(3, optimizer=ADAMW, persistence_threshold=0)
    torch.manual_seed(0)
    with Init(config=config):
        model = TinyGPT(cfg)
    num_params = reference_model.num_params()
    world_size = dist.get_world_size()
    held = sum(
        t.untyped_storage().nbytes() for t in model.parameters()
    )  # sharded parameters hold no storage of their own
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    reference = ReferenceDP(reference_model, _reference_adamw)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for step in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=generator)
        engine.backward(engine.module.loss(tokens[:, :-1], tokens[:, 1:]))
        reference.run_backward(
            lambda t=tokens: reference_model.loss(t[:, :-1], t[:, 1:]).backward()
        )
        assert_grads_match(model, reference, f"Init-built GPT, step {step}")
        engine.step()
        reference.step()
        reference.zero_grad()
        assert_params_match(model, reference, f"Init-built GPT, after step {step}")
    measured = engine.model_state_bytes().total
    largest_group = max(s.flat.padded_numel for s in engine.groups) * 4
    engine.destroy()
    return {
        "held_after_init": held,
        "measured": measured,
        "ideal": ideal_model_state_bytes(num_params, 3, world_size),
        "largest_group_bytes": largest_group,
        "full_bytes": num_params * 4,
    }


def test_init_memory_is_a_shard_and_training_matches(pools) -> None:
    for report in pools(2).run(init_memory_and_training):
        assert report["held_after_init"] == 0, report
        # 16 bytes per parameter over 2 ranks, within 10%, plus the largest gathered group.
        assert report["measured"] <= 1.10 * report["ideal"] + report["largest_group_bytes"], report
        assert report["measured"] >= 0.90 * report["ideal"], report


def reduction_buckets_with_persistent_groups() -> dict[str, int]:
    """Gradient bucket elements a stage 3 GPT holds, its small parameters persistent."""
    cfg = TinyGPTConfig(vocab_size=128, seq_len=16, n_layer=4, n_head=2, d_model=64)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    # Biases and norms (< 1000 elements) persistent; each module's weights one group each.
    config = zerodp_config(
        3, optimizer=ADAMW, persistence_threshold=1000, zero={"stage3_units": "modules"}
    )
    config["zero_optimization"]["reduce_bucket_size"] = 20_000
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=generator)
        engine.backward(engine.module.loss(tokens[:, :-1], tokens[:, 1:]))
        engine.step()
    sizes = [s.flat.padded_numel for s in engine.groups]
    persistent = [s.flat.padded_numel for s in engine.groups if s.flat.persistent]
    held = engine.reducer.bucket_numel_held
    engine.destroy()
    return {"held": held, "total": sum(sizes), "largest": max(sizes), "persistent": len(persistent)}


def test_persistent_groups_do_not_hold_up_reductions(pools) -> None:
    """A persistent group spans every block, so it is complete only at the backward's end;
    reduced first (by its latest member) it held every later group's full-size bucket out
    until then. Reduced in completion order, a backward needs a few buckets at once."""
    for report in pools(2).run(reduction_buckets_with_persistent_groups):
        assert report["persistent"] >= 1, report
        # in flight (<= reduce_bucket_size) + the one being filled + the persistent one(s)
        bound = 20_000 + report["largest"] * (2 + report["persistent"])
        assert report["held"] <= bound, report
        assert report["held"] < report["total"] / 2, report


def buckets_after_backward_and_step(stage: int) -> dict[str, int]:
    """Idle bucket elements after each backward and step, with gradients checked on the way.

    The second step runs two backward passes on one retained graph (two tasks, whose
    gradients add up), so a task's release cannot drop a bucket the next one needs."""
    cfg = TinyGPTConfig(vocab_size=128, seq_len=16, n_layer=4, n_head=2, d_model=64)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    ref_model = copy.deepcopy(model)
    config = zerodp_config(stage, optimizer=ADAMW, persistence_threshold=1000)
    config["zero_optimization"]["reduce_bucket_size"] = 20_000
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    reference = ReferenceDP(ref_model, _reference_adamw)
    idle = []
    trainable = [s for s in engine.groups if s.grads is not None]
    # Zero kept gradients hold no memory: after the build, and after each step.
    unreleased = [sum(not s.grads.released for s in trainable)]  # type: ignore[union-attr]
    for step in range(2):
        tokens = gpt_tokens(dist.get_rank(), step, cfg)
        loss = engine.module.loss(tokens[:, :-1], tokens[:, 1:])
        ref_loss = ref_model.loss(tokens[:, :-1], tokens[:, 1:])
        for again in range(step + 1):
            retain = again < step
            engine.backward(loss, retain_graph=retain)
            reference.run_backward(lambda r=retain, lo=ref_loss: lo.backward(retain_graph=r))
            idle.append(engine.reducer.bucket_numel_idle)
        assert_grads_match(model, reference, f"stage {stage}, step {step}")
        engine.step()
        reference.step()
        reference.zero_grad()
        idle.append(engine.reducer.bucket_numel_idle)
        unreleased.append(sum(not s.grads.released for s in trainable))  # type: ignore[union-attr]
        assert_params_match(model, reference, f"stage {stage}, after step {step}")
    report = {
        "unreleased_max": max(unreleased),
        "idle_max": max(idle),
        "held_max": engine.reducer.bucket_numel_held,
        "buckets_total": sum(s.flat.padded_numel for s in engine.groups if s.grads is not None),
    }
    engine.destroy()
    return report


def buckets_after_backward_and_step_all() -> list[dict[str, int]]:
    return [buckets_after_backward_and_step(stage) for stage in (2, 3)]


def test_buckets_are_let_go_after_each_backward(pools) -> None:
    """No full-size bucket is kept idle through the step and the next forward, where
    activations peak; within a backward buckets are still reused (the most held at once
    stays below one bucket per group). Nor is a zero kept gradient: each holds no memory
    from the step to the next backward's reduction of its group."""
    for reports in pools(2).run(buckets_after_backward_and_step_all):
        for report in reports:
            assert report["held_max"] > 0, report
            assert report["idle_max"] == 0, report
            assert report["held_max"] < report["buckets_total"], report
            assert report["unreleased_max"] == 0, report


# -- GatheredParameters and full state dicts --------------------------------------------


def gathered_parameters_modifier() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    ref_model = copy.deepcopy(model)
    config = zerodp_config(3, optimizer=ADAMW, persistence_threshold=0)
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    reference = ReferenceDP(ref_model, _reference_adamw)
    rank = dist.get_rank()
    weight = model.fc1.weight
    with GatheredParameters([weight]), torch.no_grad():
        before = weight.detach().clone()
        weight.add_(100.0)  # no modifier rank: discarded on exit
    with GatheredParameters([weight]):
        torch.testing.assert_close(weight.detach(), before)
    with GatheredParameters([weight], modifier_rank=1), torch.no_grad():
        if rank == 1:
            weight.fill_(0.5)
    assert param_status(weight) is ParamStatus.NOT_AVAILABLE
    full = zerodp.utils.safe_get_full_fp32_param(weight)
    torch.testing.assert_close(full, torch.full_like(full, 0.5))
    with torch.no_grad():
        ref_model.fc1.weight.fill_(0.5)  # what rank 1 wrote, on the plain model
    x = tiny_inputs(rank, 0)
    engine.backward(_loss(engine(x)))  # and training goes on
    engine.step()
    reference.run_backward(lambda: _loss(ref_model(x)).backward())
    reference.step()
    state = zerodp.zero.full_state_dict(model, rank0_only=True)
    everywhere = zerodp.zero.full_state_dict(model)
    assert (len(state) > 0) == (rank == 0)
    assert set(everywhere) == set(TinyNet().state_dict())
    plain = TinyNet()
    plain.load_state_dict(everywhere, strict=True)
    # The values are the trained model's: the plain model trained alongside, step for step.
    expected = ref_model.state_dict()
    assert list(everywhere) == list(expected)
    for name, value in everywhere.items():
        torch.testing.assert_close(value, expected[name], **FP32_TOLERANCE, msg=name)
        if rank == 0:
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    engine.destroy()


def test_gathered_parameters_and_full_state_dict(pools) -> None:
    pools(2).run(gathered_parameters_modifier)


# -- prefetch, order changes, the live-parameter cap -------------------------------------


class BranchNet(nn.Module):
    """Takes a different branch (and so a different module order) when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        first, second = (self.b, self.a) if swap else (self.a, self.b)
        return self.out(self.c(torch.tanh(second(torch.tanh(first(x))))))


def prefetch_and_order_changes(max_live: int) -> dict[str, int]:
    torch.manual_seed(0)
    model = BranchNet()
    ref_model = copy.deepcopy(model)
    config = zerodp_config(
        3,
        optimizer=ADAMW,
        persistence_threshold=0,
        zero={"stage3_prefetch_bucket_size": 10_000, "stage3_max_live_parameters": max_live},
    )
    engine, _, _, _ = zerodp.initialize(model=model, config=config)
    reference = ReferenceDP(ref_model, _reference_adamw)
    gatherer = engine.params.gatherer
    rank = dist.get_rank()
    peak = 0
    for step, swap in enumerate([False, False, False, True, True, False]):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
        gatherer.reset_peak()
        engine.backward(_loss(engine(x, swap=swap)))
        peak = max(peak, gatherer.peak_live_numel)  # forward and backward of every step
        reference.run_backward(lambda x=x, s=swap: _loss(ref_model(x, swap=s)).backward())
        assert_grads_match(model, reference, f"step {step}, swap {swap}")
        engine.step()
        reference.step()
        reference.zero_grad()
        assert_all_released(model, 3)
    largest = max(s.flat.padded_numel for s in engine.params.sharded_states)
    report = {
        "divergences": engine.params.coordinator.forward_trace.num_divergences,
        "prefetched": gatherer.num_prefetched,
        "peak": peak,
        "largest": largest,
        "sizes": sorted(s.flat.padded_numel for s in engine.params.sharded_states),
    }
    engine.destroy()
    return report


def prefetch_under_caps(caps: list[int]) -> list[dict[str, int]]:
    """`prefetch_and_order_changes` once per cap, in one call (one spawn for every cap)."""
    return [prefetch_and_order_changes(max_live) for max_live in caps]


UNCAPPED, CAP = 1_000_000_000, 80


def test_prefetch_follows_order_changes_exactly(pools) -> None:
    for rank_reports in pools(2).run(prefetch_under_caps, [UNCAPPED, CAP]):
        for report in rank_reports:
            assert report["divergences"] >= 2, report  # the swap and the swap back were noticed
        uncapped, capped = rank_reports
        assert uncapped["prefetched"] > 0, uncapped
        # Prefetching stops at the cap; a gather that is needed goes ahead anyway.
        assert capped["peak"] <= CAP + 2 * capped["largest"], capped
        # The coordinator's rules bound the peak tighter: a prefetch is issued only if it
        # keeps the live elements within the cap, and a group is kept after its use only
        # while they are within the cap, so the live elements exceed the cap only by the
        # one group a module needs now (BranchNet's modules are leaves, one group each).
        assert capped["peak"] <= CAP + capped["largest"], capped
        assert capped["peak"] < uncapped["peak"], (capped, uncapped)
        assert uncapped["peak"] > CAP + capped["largest"], uncapped  # without a cap, exceeded
        # A prefetch runs right after a group is requested (so that group is live): here no
        # two groups fit under the cap together, so nothing may be prefetched at all.
        smallest, second, *_ = capped["sizes"]
        assert smallest + second > CAP, capped
        assert capped["prefetched"] == 0, capped
