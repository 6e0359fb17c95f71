"""What a validated config turns on, in the terms of the composition table.

The table itself (`zerodp.parallel.composition`, [Note: composition table])
decides which pairs compose; this module only reads a config: the size of each
parallel dimension and which of the table's features its keys enable. Config
validation refuses every pair the table refuses, naming both keys and the fix.
"""

from __future__ import annotations

from typing import Any

from zerodp.parallel.composition import Dimension, Feature, refusals


def dimension_sizes(config: Any) -> dict[Dimension, int]:
    """Each dimension's size in `config` (a `ZeroDPConfig`, typed loosely: this module sits
    below it)."""
    return {
        Dimension.SEQUENCE: config.sequence_parallel_size,
        Dimension.TENSOR: config.tensor_parallel.size,
        Dimension.EXPERT: config.expert_parallel.size,
    }


def features_on(config: Any) -> dict[Feature, str]:
    """The table's features that `config`'s keys turn on, each with its setting."""
    zero = config.zero_optimization
    on = {
        Feature.SHARD_GROUPS: (zero.mics_shard_size > 0, str(zero.mics_shard_size)),
        Feature.HPZ: (zero.zero_hpz_partition_size > 1, str(zero.zero_hpz_partition_size)),
        Feature.OFFLOAD_PARAM: _offload(zero.offload_param),
        Feature.OFFLOAD_OPTIMIZER: _offload(zero.offload_optimizer),
        Feature.COMPILE: (config.compile.enabled, "true"),
        Feature.EIGENVALUE: (config.eigenvalue.enabled, "true"),
    }
    return {feature: value for feature, (enabled, value) in on.items() if enabled}


def composition_problems(config: Any) -> list[str]:
    """Every pair of a dimension and a feature `config` turns on that the table refuses."""
    return refusals(features_on(config), dimension_sizes(config))


def _offload(section: Any) -> tuple[bool, str]:
    on = section is not None and section.device != "none"
    return on, repr(section.device) if on else ""
