"""Expert parallelism without processes: each HF MoE model's own plan, plans from patterns, every
check `split_experts` makes before anything changes, the split itself, and the routing arithmetic.

`split_experts` makes no collective (every rank checks the same model), so a stand-in for the
group's `Comm` (its rank and size) is enough here; the forward, which communicates, is tested in
tests/distributed/test_expert_parallel_layer.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from tests.hf_moe_models import BUILDERS, EXPERT_LAYERS, NUM_EXPERTS, build, experts_of
from tests.moe_models import MoEConfig, MoELM
from zerodp.errors import ConfigError
from zerodp.expert_parallel import (
    ExpertGroup,
    ExpertSlice,
    PlanSource,
    dispatch_experts,
    find_experts,
    read_plan,
    split_experts,
)
from zerodp.expert_parallel.routing import expert_counts, local_expert_index, order_by_expert

PATTERN = ["model.layers.*.mlp.experts"]


def group(rank: int, size: int) -> Any:
    """A stand-in for an EP group's `Comm`: `split_experts` reads only its place and size."""
    return SimpleNamespace(rank=rank, world_size=size)


# -- the plans ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_models_own_plan_finds_its_experts(name: str) -> None:
    model = build(name)
    plan = read_plan(model, None)
    assert plan.source is PlanSource.MODEL
    found = find_experts(model, plan)
    assert [f.name for f in found] == [f"model.layers.{i}.mlp.experts" for i in EXPERT_LAYERS[name]]
    biases = ("gate_up_proj_bias", "down_proj_bias") if name == "gpt_oss" else ()
    for experts in found:
        assert (experts.num_experts, experts.count_attribute) == (NUM_EXPERTS, "num_experts")
        assert sorted(experts.tensors) == sorted(("gate_up_proj", "down_proj", *biases))


def test_patterns_name_the_same_experts_and_every_pattern_must_match() -> None:
    model = build("mixtral")
    by_patterns = find_experts(model, read_plan(model, PATTERN))
    by_own = find_experts(model, read_plan(model, None))
    assert read_plan(model, "model.layers.*.mlp.experts").source is PlanSource.CONFIG
    assert [(f.name, f.tensors) for f in by_patterns] == [(f.name, f.tensors) for f in by_own]
    with pytest.raises(ConfigError, match=r"'model\.layers\.\*\.moe' match no module"):
        find_experts(model, read_plan(model, [*PATTERN, "model.layers.*.moe"]))


def test_a_model_without_a_plan_needs_patterns() -> None:
    model = MoELM(MoEConfig())
    with pytest.raises(ConfigError, match=re.escape("give expert_parallel.plan")):
        split_experts(model, 2, 0, group(0, 2), None)


def test_a_models_own_plan_that_matches_nothing_is_an_error() -> None:
    wrapped = nn.Sequential(build("qwen3_moe"))  # names become "0.model.layers..."
    wrapped._ep_plan = dict(wrapped[0]._ep_plan)  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="match none of its modules"):
        split_experts(wrapped, 2, 0, group(0, 2), None)
    split = split_experts(wrapped, 2, 0, group(0, 2), ["0.model.layers.*.mlp.experts"])
    assert len(split.modules) == 2


# -- the checks before a split, nothing changed ----------------------------------------------


def snapshot(model: nn.Module) -> list[Any]:
    return [(n, p, p.shape) for n, p in model.named_parameters()] + [
        (type(m), getattr(m, "num_experts", None)) for m in model.modules()
    ]


def test_an_expert_count_the_size_does_not_divide_is_refused_naming_the_fix() -> None:
    model = build("qwen3_moe")
    before = snapshot(model)
    message = re.escape(
        "expert_parallel.autoep_size 3 cannot split the experts of Qwen3MoeForCausalLM: "
        "'model.layers.0.mlp.experts' has 8 experts (model.layers.0.mlp.experts.num_experts), "
        "not divisible by 3: use an expert_parallel.autoep_size that divides 8 (2, 4, 8)"
    )
    with pytest.raises(ConfigError, match=message):
        split_experts(model, 3, 0, group(0, 3), None)
    after = snapshot(model)
    assert len(before) == len(after)
    assert all(a[0] == b[0] and a[1] is b[1] for a, b in zip(before, after, strict=True))


class FusedExperts(nn.Module):
    """A user's experts module: fused tensors, experts first, the HF forward signature."""

    def __init__(self, num_experts: int = 4, first_dims: tuple[int, int] = (4, 4)) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(first_dims[0], 6, 5))
        self.w_out = nn.Parameter(torch.randn(first_dims[1], 5, 6))

    def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        raise NotImplementedError  # the checks never run it


class Block(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts
        self.other = nn.Linear(6, 6)


def refusal(experts: nn.Module, size: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        split_experts(Block(experts), size, 0, group(0, size), ["experts"])
    return str(info.value)


def test_each_check_names_the_problem() -> None:
    shape = "'experts.w_out' has shape (3, 5, 6), not experts-first with experts.num_experts = 4"
    assert shape in refusal(FusedExperts(first_dims=(4, 3)))
    no_count = FusedExperts()
    del no_count.num_experts
    assert "keeps no number of experts: give it an int attribute 'num_experts'" in refusal(no_count)

    class OtherForward(FusedExperts):
        def forward(self, x: Any) -> Any:  # type: ignore[override]
            return x

    assert "has forward(x); an experts module's forward takes (hidden_states" in refusal(
        OtherForward()
    )
    empty = FusedExperts()
    empty.w_in, empty.w_out = None, None  # type: ignore[assignment]
    assert "holds no expert tensor" in refusal(empty)


def test_an_expert_tensor_tied_to_an_ordinary_parameter_is_refused() -> None:
    block = Block(FusedExperts())
    holder = nn.Module()
    holder.w = block.experts.w_in
    model = nn.ModuleDict({"block": block, "holder": holder})
    with pytest.raises(ConfigError, match=r"'block\.experts\.w_in' is shared with 'holder\.w'"):
        split_experts(model, 2, 0, group(0, 2), ["block.experts"])


def test_a_split_model_is_not_split_again() -> None:
    model = build("olmoe")
    split_experts(model, 2, 1, group(1, 2), None)
    with pytest.raises(ConfigError, match="is split already"):
        split_experts(model, 2, 1, group(1, 2), None)


def test_the_group_must_be_the_one_asked_for() -> None:
    with pytest.raises(ValueError, match="pass the Comm of this rank's expert-parallel group"):
        split_experts(build("olmoe"), 2, 1, group(0, 2), None)


# -- the split -------------------------------------------------------------------------------


def test_each_rank_keeps_its_experts_under_the_models_own_names() -> None:
    whole = build("gpt_oss")
    names = [n for n, _ in whole.named_parameters()]
    values = {n: p.detach().clone() for n, p in whole.named_parameters()}
    for rank in range(4):
        model = build("gpt_oss")
        old = dict(model.named_parameters())
        split = split_experts(model, 4, rank, group(rank, 4), None)
        assert [n for n, _ in model.named_parameters()] == names
        assert sorted(split.modules) == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
        assert len(split.names) == 8 and split.size == 4 and split.rank == rank
        for name, param in model.named_parameters():
            record = split.expert_of(name)
            if record is None:
                assert param is old[name] and not split.is_expert(param)
                continue
            # The same parameter object keeps only this rank's experts (what holds it, an
            # optimizer built before the split, still holds it).
            assert split.is_expert(param) and param is old[name]
            assert record.global_shape == tuple(values[name].shape)
            expected = values[name][2 * rank : 2 * rank + 2]
            assert torch.equal(param.detach(), expected) and param.requires_grad
            assert torch.equal(split.local_part_named(name, values[name]), expected)
        for experts in experts_of(model):
            assert experts.num_experts == 2
            assert type(experts).__name__ == "ExpertParallelGptOssExperts"
            assert f"experts {2 * rank}..{2 * rank + 1} of 8" in repr(experts)


def test_at_size_one_nothing_changes() -> None:
    model = build("qwen3_moe")
    before = snapshot(model)
    split = split_experts(model, 1, 0, group(0, 1), None)
    assert len(split.names) == 4
    assert all(a[1] is b[1] for a, b in zip(before, snapshot(model), strict=True))


# -- routing ---------------------------------------------------------------------------------


def test_assignments_are_ordered_by_expert_and_masked_slots_go_nowhere() -> None:
    index = torch.tensor([[3, 0], [8, 3], [1, -1], [0, 7]])  # 8 and -1 are outside [0, 8)
    counts = expert_counts(index, 8)
    assert counts.tolist() == [2, 1, 0, 2, 0, 0, 0, 1]
    order = order_by_expert(index, 8, int(counts.sum()))
    slots = [s for s, e in enumerate(index.reshape(-1).tolist()) if 0 <= e < 8]
    expected = sorted(slots, key=lambda s: (index.reshape(-1)[s].item(), s))
    assert order.slots.tolist() == expected
    assert order.tokens.tolist() == [s // 2 for s in expected]
    # Rows arrive by source rank, and from one source by local expert.
    received = torch.tensor([[2, 0], [1, 3]])
    assert local_expert_index(received, 2).tolist() == [0, 0, 0, 1, 1, 1]


def test_a_router_choice_that_does_not_fit_the_tokens_is_refused_before_any_exchange() -> None:
    held = ExpertSlice(global_experts=8, local_experts=4, first_expert=0)
    group = ExpertGroup(SimpleNamespace(rank=0, world_size=2), 0, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not name the same K slots of each of the 4 tokens"):
        dispatch_experts(
            torch.zeros(4, 6),
            torch.zeros(4, 2, dtype=torch.long),
            torch.zeros(4, 3),
            group=group,
            experts=held,
            local_forward=lambda *args: args[0],
            params=[],
        )


def test_a_forward_set_on_the_experts_instance_is_refused_naming_the_hooks() -> None:
    """accelerate's device_map hooks set a forward on the instance, which the dispatch would
    bypass; the message says so rather than calling the model split."""
    model = build("olmoe")
    experts = experts_of(model)[0]
    experts.forward = experts.forward  # what a hook-installing wrapper does
    with pytest.raises(ConfigError, match="has a forward set on the instance") as caught:
        split_experts(model, 2, 1, group(1, 2), None)
    assert "split already" not in str(caught.value)
