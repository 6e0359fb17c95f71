"""The composition table: what config validation and the run-time checks refuse is what the
table says, and docs/architecture.md prints the table as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from zerodp.config import load_config
from zerodp.config.parallel_features import dimension_sizes, features_on
from zerodp.errors import ConfigError
from zerodp.parallel import ParallelDims
from zerodp.parallel.composition import (
    PAIRS,
    TABLE,
    Dimension,
    Feature,
    markdown_table,
    refusal,
    refusal_for,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"

# A config that turns each config-key feature on (with a stage that allows it).
TURNS_ON: dict[Feature, dict[str, Any]] = {
    Feature.SHARD_GROUPS: {"zero_optimization": {"stage": 2, "mics_shard_size": 2}},
    Feature.HPZ: {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
    Feature.OFFLOAD_PARAM: {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
    Feature.OFFLOAD_OPTIMIZER: {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    },
    Feature.COMPILE: {"compile": {"enabled": True}},
    Feature.EIGENVALUE: {"eigenvalue": {"enabled": True}},
}
SIZE_KEYS: dict[Dimension, dict[str, Any]] = {
    Dimension.SEQUENCE: {"sequence_parallel_size": 2},
    Dimension.TENSOR: {"tensor_parallel": {"autotp_size": 2}},
    Dimension.EXPERT: {"expert_parallel": {"enabled": True, "autoep_size": 2}},
}


def _config(**extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 1, **extra}


def test_every_feature_has_a_cell_for_every_dimension() -> None:
    assert set(TABLE) == set(Feature)
    for feature, cells in TABLE.items():
        assert set(cells) == set(Dimension), feature


def test_the_docs_print_the_table() -> None:
    assert markdown_table() in DOC.read_text()


def test_every_composes_cell_names_a_test_that_exists() -> None:
    root = DOC.parents[1]
    cells = [((f, d), cell) for f, row in TABLE.items() for d, cell in row.items()]
    cells += [(tuple(pair), cell) for pair, cell in PAIRS.items()]
    for where, cell in cells:
        if cell.composes:
            assert (root / cell.note.split(" ")[0]).is_file(), (where, cell)


@pytest.mark.parametrize("feature", list(TURNS_ON))
@pytest.mark.parametrize("dimension", list(Dimension))
def test_config_validation_refuses_exactly_what_the_table_refuses(
    feature: Feature, dimension: Dimension
) -> None:
    config = load_config(_config(**TURNS_ON[feature]), world_size=4)
    assert feature in features_on(config)  # the config turns it on, alone it loads
    both = {**TURNS_ON[feature], **SIZE_KEYS[dimension]}
    if TABLE[feature][dimension].composes:
        loaded = load_config(_config(**both), world_size=4)
        assert dimension_sizes(loaded)[dimension] == 2
        return
    with pytest.raises(ConfigError) as caught:
        load_config(_config(**both), world_size=4)
    message = str(caught.value)
    assert f"{dimension.key} 2 with {feature.config_key}" in message, message
    assert feature.instead in message and f"or set {dimension.key} to 1" in message, message


def test_the_run_time_checks_ask_the_table_with_the_runs_dims() -> None:
    alone = ParallelDims.build(4, 0)
    runs = {
        Dimension.SEQUENCE: ParallelDims.build(4, 0, sequence_size=2),
        Dimension.TENSOR: ParallelDims.build(4, 0, tensor_size=2),
        Dimension.EXPERT: ParallelDims.build(4, 0, expert_size=2),
    }
    assert set(runs) == set(Dimension)
    for feature in Feature:
        assert refusal_for(feature, alone) is None
        for dimension, dims in runs.items():
            refused = refusal_for(feature, dims)
            assert (refused is None) == TABLE[feature][dimension].composes, (feature, dimension)
    assert refusal(Feature.JOIN, {Dimension.SEQUENCE: 1, Dimension.TENSOR: 1}) is None


@pytest.mark.parametrize(
    ("first", "second"), [tuple(sorted(p, key=list(Dimension).index)) for p in PAIRS]
)
def test_config_validation_refuses_exactly_the_pairs_of_dimensions_the_table_refuses(
    first: Dimension, second: Dimension
) -> None:
    config = _config(**SIZE_KEYS[first], **SIZE_KEYS[second])
    if PAIRS[frozenset({first, second})].composes:
        load_config(config, world_size=4)
        return
    with pytest.raises(ConfigError, match=f"{first.key} 2 with {second.key} 2"):
        load_config(config, world_size=4)


@pytest.mark.parametrize("dimension", list(Dimension))
def test_router_logits_are_refused_at_the_forward_where_the_table_refuses_them(
    dimension: Dimension,
) -> None:
    """output_router_logits=True, asked by the forward's argument or the model's config, is
    refused at the forward on a run whose dims the table refuses it with; asked for nothing,
    or on a run that takes it, the forward runs."""
    from types import SimpleNamespace

    from torch import nn

    from zerodp.engine.composition_checks import refuse_router_aux_loss_where_refused
    from zerodp.errors import UsageError

    class MoELike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(output_router_logits=False)
            self.gate = nn.Linear(2, 2)

        def forward(self, x: Any, output_router_logits: bool | None = None) -> Any:
            return self.gate(x)

    key = {Dimension.SEQUENCE: "sequence_size", Dimension.TENSOR: "tensor_size"}
    sizes = {key.get(dimension, "expert_size"): 2}
    dims = ParallelDims.build(4, 0, **sizes)
    model = MoELike()
    handle = refuse_router_aux_loss_where_refused(model, SimpleNamespace(dims=dims))  # type: ignore[arg-type]
    x = torch.ones(1, 2)
    model(x)
    model(x, output_router_logits=False)
    if TABLE[Feature.ROUTER_AUX_LOSS][dimension].composes:
        model(x, output_router_logits=True)
        return
    with pytest.raises(UsageError, match="output_router_logits"):
        model(x, output_router_logits=True)
    with pytest.raises(UsageError, match="output_router_logits"):
        model(x, True)  # by position
    model.config.output_router_logits = True
    with pytest.raises(UsageError, match="output_router_logits"):
        model(x)
    model(x, output_router_logits=False)  # the argument decides over the config
    assert handle is not None
    handle.remove()  # engine.destroy(): the model is the user's again
    model(x, output_router_logits=True)
