"""The parallel dimensions (data, shard, replica, sequence, tensor, expert) and their rules.

One object, `ParallelDims`, answers every question that depends on how the ranks
are laid out: which group reduces a gradient and what it is divided by, which
groups a gradient norm is summed over, which ranks read the same samples. See
[Note: parallel dimensions] in `zerodp.parallel.dims`. Pure arithmetic: the
process groups are built from it by `zerodp.comm.subgroups`.
"""

from zerodp.parallel.dims import (
    EXPERT,
    EXPERT_DATA,
    LABELS,
    REPLICA,
    SECONDARY,
    SEQUENCE,
    SHARD,
    SLICE,
    TENSOR,
    WORLD,
    ParallelDims,
)
from zerodp.parallel.sequence_slice import SequenceSlice
from zerodp.parallel.sizes import data_parallel_size, size_problems

__all__ = [
    "EXPERT",
    "EXPERT_DATA",
    "LABELS",
    "REPLICA",
    "SECONDARY",
    "SEQUENCE",
    "SHARD",
    "SLICE",
    "TENSOR",
    "WORLD",
    "ParallelDims",
    "SequenceSlice",
    "data_parallel_size",
    "size_problems",
]
