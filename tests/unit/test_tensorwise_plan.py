"""The tensor-wise step's decisions, without processes: which path a class takes, who owns which
tensor and what travels (pure layout arithmetic), and DeepSpeed's Muon rule and settings."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from zerodp.config import load_config
from zerodp.errors import ConfigError
from zerodp.optim.muon_config import split_for_muon
from zerodp.optim.param_groups import ParamGroupSpec
from zerodp.optim.tensorwise import (
    ALL_RANKS,
    GroupLayout,
    OwnerPlacement,
    UpdatePath,
    build_plan,
    declare_elementwise,
    update_path,
)
from zerodp.optim.tensorwise.ownership import update_cost
from zerodp.partition.layout import FlatLayout

# One flat group as LayoutNet lays it out: proj.weight, head.bias, head.weight, gain, a.bias,
# a.weight, scale (528 elements).
SHAPES = [(24, 10), (10,), (10, 6), (6,), (6,), (6, 5), (176,)]
NAMES = ("proj.weight", "head.bias", "head.weight", "gain", "a.bias", "a.weight", "scale")


def _group(world_size: int, owns_full: bool = False, resident: bool = True) -> GroupLayout:
    return GroupLayout(
        order=0,
        names=NAMES,
        layout=FlatLayout.build(SHAPES, world_size),
        owns_full=owns_full,
        values_resident=resident,
    )


def test_holders_step_a_tensor_where_it_lies_and_move_only_straddling_ones() -> None:
    plan = build_plan([_group(3)], OwnerPlacement.HOLDERS)
    by_name = {t.name: t for t in plan.tasks}
    # proj.weight spans ranks 0 and 1 (shards of 176); everything else lies in one shard.
    assert [f.rank for f in by_name["proj.weight"].fragments] == [0, 1]
    assert by_name["proj.weight"].owner in (0, 1)
    for name in NAMES[1:]:
        task = by_name[name]
        assert len(task.fragments) == 1 and task.owner == task.fragments[0].rank, name
    assert by_name["scale"].owner == 2  # rank 2's shard holds no matrix
    for task in plan.tasks:  # the fragments tile each tensor, in order
        assert task.fragments[0].start == 0 and task.fragments[-1].end == task.numel
        for left, right in zip(task.fragments, task.fragments[1:], strict=False):
            assert left.end == right.start
    moved = sum(f.numel for f in by_name["proj.weight"].remote_fragments())
    assert plan.elements_in() == moved  # values resident everywhere: gradients only
    assert plan.elements_out() == moved
    values_travel = build_plan([_group(3, resident=False)], OwnerPlacement.HOLDERS)
    assert values_travel.elements_in() == 2 * moved


def test_a_straddling_tensor_goes_to_the_least_loaded_holder() -> None:
    plan = build_plan([_group(3)], OwnerPlacement.HOLDERS)
    proj = next(t for t in plan.tasks if t.name == "proj.weight")
    # Rank 0 holds nothing else; rank 1 holds head and a: rank 0 is the least loaded holder.
    assert proj.owner == 0
    assert proj.is_local(0) is False and proj.owned_by(0)


def test_balanced_placement_spreads_cost_over_all_ranks() -> None:
    shapes = [(64, 64)] * 6 + [(64,)] * 6
    layout = FlatLayout.build(shapes, 4)
    names = tuple(f"p{i}" for i in range(len(shapes)))
    group = GroupLayout(0, names, layout, owns_full=False, values_resident=True)
    balanced = build_plan([group], OwnerPlacement.BALANCED).cost_by_rank()
    holders = build_plan([group], OwnerPlacement.HOLDERS).cost_by_rank()
    assert max(balanced) - min(balanced) <= update_cost((64, 64))
    assert max(balanced) <= max(holders)
    assert sum(balanced) == pytest.approx(sum(holders))


def test_stage_zero_replicates_every_tensor() -> None:
    plan = build_plan([_group(2, owns_full=True)], OwnerPlacement.HOLDERS)
    assert plan.placement is OwnerPlacement.REPLICATED
    assert not plan.moves_anything
    offsets = [t.fragments[0].offset for t in plan.tasks]
    assert offsets == [sum(math.prod(s) for s in SHAPES[:i]) for i in range(len(SHAPES))]
    assert all(t.owner == ALL_RANKS and t.is_local(1) for t in plan.tasks)


def test_update_cost_is_the_matrix_products_of_an_orthogonalization() -> None:
    assert update_cost((24, 10)) == 24 * 10 * 10
    assert update_cost((3, 4, 5)) == 60 * 3
    assert update_cost((7,)) == 7


def test_path_by_class() -> None:
    assert update_path(torch.optim.AdamW) is UpdatePath.ELEMENTWISE
    assert update_path(torch.optim.SGD) is UpdatePath.ELEMENTWISE
    assert update_path(torch.optim.Muon) is UpdatePath.TENSORWISE
    assert update_path(torch.optim.Adafactor) is UpdatePath.TENSORWISE

    class MyAdam(torch.optim.AdamW):  # may change the update: not assumed elementwise
        pass

    assert update_path(MyAdam) is UpdatePath.TENSORWISE
    assert declare_elementwise(MyAdam) is MyAdam
    assert update_path(MyAdam) is UpdatePath.ELEMENTWISE
    with pytest.raises(TypeError, match="zerodp cannot step LBFGS"):
        update_path(torch.optim.LBFGS)
    with pytest.raises(ValueError, match="reads whole tensors"):
        declare_elementwise(torch.optim.Muon)
    with pytest.raises(TypeError, match="subclass"):
        declare_elementwise(nn.Linear)  # type: ignore[arg-type]


class _Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 4)
        self.block = nn.Linear(4, 4)
        self.conv = nn.Conv1d(4, 3, 2)
        self.lm_head = nn.Linear(4, 11, bias=False)


def _muon_params(**params: object) -> dict[str, object]:
    config = load_config(
        {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "muon", "params": params}},
        world_size=1,
    )
    assert config.optimizer is not None
    return config.optimizer.params


def test_deepspeed_rule_splits_matrices_from_the_rest() -> None:
    model = _Named()
    names = {id(p): n for n, p in model.named_parameters()}
    specs, sources, step_shapes = split_for_muon(
        [ParamGroupSpec(list(model.parameters()))], names, _muon_params()
    )
    muon, adam = sources
    assert muon.cls is torch.optim.Muon
    assert adam.cls is torch.optim.AdamW
    in_muon = {names[id(p)] for i in muon.groups for p in specs[i].params}
    assert in_muon == {"block.weight", "conv.weight"}  # not embed_tokens, not lm_head
    assert step_shapes == {"conv.weight": (3, 8)}  # a filter as a matrix
    assert muon.kwargs["lr"] == 0.02 and adam.kwargs["lr"] == 3e-4  # DeepSpeed's defaults
    assert adam.kwargs["betas"] == (0.9, 0.95) and adam.kwargs["eps"] == 1e-10
    assert muon.kwargs["weight_decay"] == 0.0 and muon.kwargs["momentum"] == 0.95


def test_settings_from_shared_to_half_to_group() -> None:
    model = _Named()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [
        ParamGroupSpec([model.block.weight, model.block.bias], {"lr": 0.5, "betas": (0.1, 0.2)}),
        ParamGroupSpec(
            [p for n, p in model.named_parameters() if not n.startswith("block")],
            {"weight_decay": 0.0},
        ),
    ]
    params = _muon_params(lr=1e-3, adam_lr=2e-4, weight_decay=0.1, adam_w_mode=False)
    specs, (muon, adam), _ = split_for_muon(groups, names, params)
    assert muon.kwargs["lr"] == 1e-3 and adam.kwargs["lr"] == 2e-4
    assert adam.cls is torch.optim.Adam  # adam_w_mode false: L2 weight decay
    # Group 0: its lr reaches both halves, its betas only Adam's.
    assert specs[muon.groups[0]].options == {"lr": 0.5}
    assert specs[adam.groups[0]].options == {"lr": 0.5, "betas": (0.1, 0.2)}
    assert specs[muon.groups[1]].options == {"weight_decay": 0.0}


def test_muon_config_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ConfigError, match="per_head_muon"):
        _muon_params(per_head_muon=True)
    with pytest.raises(ConfigError, match="ns_method"):
        _muon_params(ns_method="svd")
    with pytest.raises(ConfigError, match="momentum"):
        _muon_params(momentun=0.9)
    assert _muon_params(ns_method="standard")["ns_method"] == "standard"


def test_a_chain_is_one_optimizer_to_schedulers_and_state_dicts() -> None:
    from zerodp.optim.torch_optimizers import GroupOptimizer, OptimizerChain, OptimizerSource

    def build() -> tuple[OptimizerChain, list[nn.Parameter]]:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
        muon = torch.optim.Muon([params[0]], lr=0.02)
        adamw = torch.optim.AdamW([{"params": [params[1]], "lr": 1e-2}])
        members = [
            GroupOptimizer(muon, UpdatePath.TENSORWISE, []),
            GroupOptimizer(adamw, UpdatePath.ELEMENTWISE, []),
        ]
        # The engine's param groups: AdamW's is group 0, Muon's group 1.
        sources = [
            OptimizerSource(groups=[1], instance=muon),
            OptimizerSource(groups=[0], instance=adamw),
        ]
        return OptimizerChain(members, sources), params

    chain, params = build()
    assert chain.class_label == "Muon+AdamW"
    assert chain.param_groups[0] is chain.optimizers[1].param_groups[0]
    assert "betas" in chain.group_defaults(0) and "ns_steps" in chain.group_defaults(1)
    chain.param_groups[1]["lr"] = 0.05  # as a scheduler would
    assert chain.optimizers[0].param_groups[0]["lr"] == 0.05
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        chain.step()
    saved = chain.state_dict()
    other, other_params = build()
    other.load_state_dict(saved)
    assert (
        other.param_groups[1]["lr"] == 0.05
        and other.param_groups[1] is other.optimizers[0].param_groups[0]
    )
    for p, q in zip(params, other_params, strict=True):
        for key, value in chain.state[p].items():
            torch.testing.assert_close(other.state[q][key], value)
    assert other.optimizers[0].state is other.state
    with pytest.raises(NotImplementedError, match="initialize"):
        other.add_param_group({"params": []})
