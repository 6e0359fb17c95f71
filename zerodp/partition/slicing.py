"""Whether a parameter is whole on every rank that holds it, or one rank's slice of a tensor.

A flat group holds parameters of one kind only: the kinds differ in which ranks hold the
same values (so which ranks a group is sharded over), and in which groups a gradient norm
is summed over (see [Note: parallel dimensions] in `zerodp.parallel.dims`).
"""

from __future__ import annotations

import enum


class Slicing(enum.Enum):
    WHOLE = "whole"  # the same values on every rank of its shard group's slice
    TENSOR = "tensor"  # a tensor-parallel slice (zerodp.tensor_parallel)
    EXPERT = "expert"  # an E-th of a layer's experts (zerodp.expert_parallel): its own shard
    # group, the ranks holding the same experts (the expert-data group)
