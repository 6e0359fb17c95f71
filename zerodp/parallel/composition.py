"""Which features compose with which parallel dimension: one table, read everywhere it matters.

[Note: composition table]
A feature either composes with a dimension (exact, and tested) or is refused
with one message that names both and the fix. The decision is data, here, not
an `if` in the module that happens to notice the pair:

- config validation (`zerodp.config.model`) reads it for every feature a
  config turns on (`Feature.config_key`), so a refused pair fails before any
  process group exists, on every rank alike (every rank validates the same
  config);
- the checks that can only be made later (a method called, a model built
  under `zero.Init`, an optimizer class) ask `refusal` with the dimensions
  the engine has, and raise on every rank through the collective that agrees
  on the outcome;
- docs/architecture.md prints the table (`markdown_table`), and a test holds
  the two equal.

A new dimension is one more entry of `Dimension` and one more column of
`TABLE`; a new feature one more row. A dimension is "on" when its size is
above 1; the rest of zerodp then never asks "is sequence parallelism on and
is hpZ on?" itself.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from zerodp.parallel.dims import ParallelDims


class Dimension(enum.Enum):
    """A parallel dimension beside data parallelism, by the config key that sizes it."""

    SEQUENCE = ("sequence_parallel_size", "sequence parallelism")
    TENSOR = ("tensor_parallel.autotp_size", "tensor parallelism")
    EXPERT = ("expert_parallel.autoep_size", "expert parallelism")

    def __init__(self, key: str, title: str) -> None:
        self.key = key
        self.title = title


class Feature(enum.Enum):
    """A feature whose composition with a dimension is decided by the table.

    `config_key` names the key that turns it on, where a config does (config
    validation checks those); `how` says how a user turns it on otherwise;
    `instead` is the fix a refusal names.
    """

    SHARD_GROUPS = (
        "shard groups",
        "zero_optimization.mics_shard_size",
        "",
        "set zero_optimization.mics_shard_size to -1 (shard over every data rank)",
    )
    HPZ = (
        "hpZ's secondary shards",
        "zero_optimization.zero_hpz_partition_size",
        "",
        "set zero_optimization.zero_hpz_partition_size to 1",
    )
    OFFLOAD_PARAM = (
        "parameter offload",
        "zero_optimization.offload_param.device",
        "",
        'set zero_optimization.offload_param.device to "none"',
    )
    OFFLOAD_OPTIMIZER = (
        "optimizer offload",
        "zero_optimization.offload_optimizer.device",
        "",
        'set zero_optimization.offload_optimizer.device to "none"',
    )
    COMPILE = ("torch.compile", "compile.enabled", "", "set compile.enabled to false")
    EIGENVALUE = (
        "the Hessian eigenvalue monitor",
        "eigenvalue.enabled",
        "",
        "set eigenvalue.enabled to false",
    )
    WHOLE_TENSOR_OPTIMIZERS = (
        "optimizers that read whole tensors (Muon, Adafactor, a class zerodp does not know as "
        "elementwise)",
        "",
        "the optimizer",
        "use an elementwise optimizer (AdamW, SGD, ...; zerodp.declare_elementwise for your own)",
    )
    JOIN = (
        "joining uneven inputs",
        "",
        "engine.join()",
        "give every data rank the same number of batches (the loader zerodp.initialize "
        "returns does)",
    )
    ZERO_INIT = (
        "a model built under zero.Init",
        "",
        "zero.Init",
        "build the model without zero.Init",
    )
    WINDOW_CHECKPOINT = (
        "a checkpoint saved inside an accumulation window",
        "",
        "engine.save_checkpoint between micro-batches",
        "save at an accumulation boundary (after engine.step() has stepped the optimizer)",
    )
    DEEPSPEED_CHECKPOINT = (
        "loading a DeepSpeed checkpoint",
        "",
        "engine.load_checkpoint of a DeepSpeed folder",
        "load it without this dimension, save the weights (engine.save_16bit_model), and load "
        "those with engine.load_state_dict()",
    )
    MERGED_ADAPTERS = (
        "streaming weights with PEFT adapters merged",
        "",
        "engine.full_parameters(merge_adapters=True)",
        "stream without merging",
    )
    ROUTER_AUX_LOSS = (
        "a mixture-of-experts model's auxiliary load-balancing loss, computed per rank over its "
        "slice of each sequence",
        "",
        "output_router_logits=True",
        "set output_router_logits to false (in the model's config or the forward's arguments)",
    )
    LIGHTNING = (
        "Lightning's ZeroDPStrategy (its loaders shard by process, not by data rank)",
        "",
        "ZeroDPStrategy",
        "use ZeroDPTrainer or a plain loop",
    )

    def __init__(self, title: str, config_key: str, how: str, instead: str) -> None:
        self.title = title
        self.config_key = config_key
        self.how = how or config_key
        self.instead = instead


class Support(enum.Enum):
    COMPOSES = "composes"
    REFUSED = "refused"


@dataclass(frozen=True)
class Cell:
    """One (dimension, feature) decision: composes (with where it is tested) or refused."""

    support: Support
    note: str  # composes: the test that shows it; refused: why, in a few words

    @property
    def composes(self) -> bool:
        return self.support is Support.COMPOSES


def composes(tested_in: str) -> Cell:
    return Cell(Support.COMPOSES, tested_in)


def refused(why: str) -> Cell:
    return Cell(Support.REFUSED, why)


_SEQUENCE_TESTS = "tests/distributed/test_sequence_parallel.py"
_TENSOR_TESTS = "tests/distributed/test_tensor_parallel.py"
_EXPERT_TESTS = "tests/distributed/test_expert_parallel.py"
_LAYOUT_TESTS = "tests/distributed/test_checkpoint_layouts.py"

TABLE: Mapping[Feature, Mapping[Dimension, Cell]] = {
    Feature.SHARD_GROUPS: {
        Dimension.SEQUENCE: refused("a shard group of data and sequence ranks is not built yet"),
        Dimension.TENSOR: refused("shard groups per tensor slice are not built yet"),
        Dimension.EXPERT: refused("expert-data groups inside shard groups are not built yet"),
    },
    Feature.HPZ: {
        Dimension.SEQUENCE: refused("secondary shards of a sequence group are not built yet"),
        Dimension.TENSOR: refused("secondary shards per tensor slice are not built yet"),
        Dimension.EXPERT: refused("secondary shards of expert-data groups are not built yet"),
    },
    Feature.OFFLOAD_PARAM: {
        Dimension.SEQUENCE: composes(_SEQUENCE_TESTS),
        Dimension.TENSOR: refused("offloaded slices are not built yet"),
        Dimension.EXPERT: refused("offloaded expert shards are not built yet"),
    },
    Feature.OFFLOAD_OPTIMIZER: {
        Dimension.SEQUENCE: composes(_SEQUENCE_TESTS),
        Dimension.TENSOR: refused("offloaded slices are not built yet"),
        Dimension.EXPERT: refused("offloaded expert shards are not built yet"),
    },
    Feature.COMPILE: {
        Dimension.SEQUENCE: refused("the all-to-alls inside a compiled graph"),
        Dimension.TENSOR: refused("the all-reduces inside a compiled graph"),
        Dimension.EXPERT: refused("the all-to-alls inside a compiled graph"),
    },
    Feature.EIGENVALUE: {
        Dimension.SEQUENCE: refused("its Hessian products are not summed over a sequence group"),
        Dimension.TENSOR: refused("its Hessian products would mix tensor slices"),
        Dimension.EXPERT: refused("its Hessian products would mix experts"),
    },
    Feature.WHOLE_TENSOR_OPTIMIZERS: {
        Dimension.SEQUENCE: composes(_SEQUENCE_TESTS),
        Dimension.TENSOR: refused("it would read each rank's slices, not the weights"),
        Dimension.EXPERT: refused("its owners would be planned over the wrong group"),
    },
    Feature.JOIN: {
        Dimension.SEQUENCE: refused("a sequence group's ranks run out of batches together"),
        Dimension.TENSOR: refused("a tensor group's ranks run out of batches together"),
        Dimension.EXPERT: refused(
            "a rank that left would not answer the all-to-alls of the experts it holds"
        ),
    },
    Feature.ZERO_INIT: {
        Dimension.SEQUENCE: composes(_SEQUENCE_TESTS),
        Dimension.TENSOR: refused("its shards are of whole weights"),
        Dimension.EXPERT: refused("its shards are of every expert"),
    },
    Feature.WINDOW_CHECKPOINT: {
        Dimension.SEQUENCE: composes(_SEQUENCE_TESTS),
        Dimension.TENSOR: composes(_LAYOUT_TESTS),
        Dimension.EXPERT: composes(_EXPERT_TESTS),
    },
    Feature.DEEPSPEED_CHECKPOINT: {
        Dimension.SEQUENCE: refused("not tested yet with sequence parallelism"),
        Dimension.TENSOR: refused("DeepSpeed's files hold whole weights, not slices"),
        Dimension.EXPERT: refused("not tested yet with expert parallelism"),
    },
    Feature.MERGED_ADAPTERS: {
        Dimension.SEQUENCE: composes("tests/distributed/test_posttrain_weights.py"),
        Dimension.TENSOR: refused("the adapters are not split as the slices are"),
        Dimension.EXPERT: refused("adapters on split experts are not merged yet"),
    },
    Feature.ROUTER_AUX_LOSS: {
        Dimension.SEQUENCE: refused("its token counts and router means span the whole sequence"),
        Dimension.TENSOR: refused("not tested yet with tensor parallelism"),
        Dimension.EXPERT: composes(_EXPERT_TESTS),
    },
    Feature.LIGHTNING: {
        Dimension.SEQUENCE: refused("a sequence group would get different batches"),
        Dimension.TENSOR: refused("a tensor group would get different batches"),
        Dimension.EXPERT: refused("not tested yet with expert parallelism"),
    },
}


# Dimensions with each other: which pairs compose (and where that is tested).
PAIRS: Mapping[frozenset[Dimension], Cell] = {
    frozenset({Dimension.SEQUENCE, Dimension.TENSOR}): composes(_SEQUENCE_TESTS),
    frozenset({Dimension.SEQUENCE, Dimension.EXPERT}): composes(_EXPERT_TESTS),
    frozenset({Dimension.TENSOR, Dimension.EXPERT}): refused(
        "the experts of a tensor-parallel model are not split over EP groups per tensor rank yet"
    ),
}


def pair_refusal(sizes: Mapping[Dimension, int]) -> str | None:
    """The message refusing the first pair of dimensions in `sizes` (those above 1) that does
    not compose; None when every pair does."""
    on = [d for d in Dimension if sizes.get(d, 1) > 1]
    for i, first in enumerate(on):
        for second in on[i + 1 :]:
            cell = PAIRS[frozenset({first, second})]
            if not cell.composes:
                return (
                    f"{first.key} {sizes[first]} with {second.key} {sizes[second]}: zerodp does "
                    f"not combine {first.title} with {second.title} yet ({cell.note}); set "
                    f"{second.key} or {first.key} to 1"
                )
    return None


def refusal(feature: Feature, sizes: Mapping[Dimension, int], value: str = "") -> str | None:
    """The message refusing `feature` with the first dimension in `sizes` (those above 1)
    it does not compose with; None when it composes with all of them. `value`: the
    feature's setting as the config has it, named in the message."""
    for dimension in Dimension:
        size = sizes.get(dimension, 1)
        if size <= 1:
            continue
        cell = TABLE[feature][dimension]
        if not cell.composes:
            return (
                f"{dimension.key} {size} with {feature.how}{' ' if value else ''}{value}: "
                "zerodp does not combine "
                f"{dimension.title} with {feature.title} yet ({cell.note}); {feature.instead}, "
                f"or set {dimension.key} to 1"
            )
    return None


def refusals(features: Mapping[Feature, str], sizes: Mapping[Dimension, int]) -> list[str]:
    """Every refusal among the dimensions' pairs and `features` (each with its setting, in
    the table's order), for a config's validation."""
    found = [pair_refusal(sizes)]
    found += [refusal(f, sizes, features[f]) for f in Feature if f in features]
    return [message for message in found if message is not None]


def markdown_table() -> str:
    """The table as docs/architecture.md prints it (a test holds the two equal)."""
    dimensions = list(Dimension)
    lines = [
        "| feature | " + " | ".join(d.title for d in dimensions) + " |",
        "|---|" + "---|" * len(dimensions),
    ]
    for feature in Feature:
        cells = []
        for dimension in dimensions:
            cell = TABLE[feature][dimension]
            cells.append(f"composes (`{cell.note}`)" if cell.composes else f"refused: {cell.note}")
        name = f"{feature.title} (`{feature.how}`)"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    rows: dict[Dimension, dict[Dimension, str]] = {}  # one row per dimension, each pair once
    for pair, cell in PAIRS.items():
        first, second = sorted(pair, key=dimensions.index)
        shown = f"composes (`{cell.note}`)" if cell.composes else f"refused: {cell.note}"
        rows.setdefault(second, {})[first] = shown
    for second in sorted(rows, key=dimensions.index):
        lines.append(
            f"| {second.title} (`{second.key}`) | "
            + " | ".join(rows[second].get(d, "") for d in dimensions)
            + " |"
        )
    return "\n".join(lines)


def sizes_of(dims: ParallelDims) -> dict[Dimension, int]:
    """Each dimension's size in a run's `ParallelDims`."""
    return {
        Dimension.SEQUENCE: dims.sequence_size,
        Dimension.TENSOR: dims.tensor_size,
        Dimension.EXPERT: dims.expert_size,
    }


def refusal_for(feature: Feature, dims: ParallelDims) -> str | None:
    """`refusal` for a run's dims: what the engine asks when a feature is used at run time."""
    return refusal(feature, sizes_of(dims))


if __name__ == "__main__":
    print(markdown_table())
