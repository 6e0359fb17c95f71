"""Whether a parameter is whole on every rank that holds it, or one rank's slice of a tensor.

A flat group holds parameters of one kind only: the kinds differ in which ranks hold the
same values (so which ranks a group is sharded over), and in which groups a gradient norm
is summed over (see [Note: parallel dimensions] in `zerodp.parallel.dims`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class Slicing(enum.Enum):
    WHOLE = "whole"  # the same values on every rank of its shard group's slice
    TENSOR = "tensor"  # a tensor-parallel slice (zerodp.tensor_parallel)
    EXPERT = "expert"  # an E-th of a layer's experts (zerodp.expert_parallel): its own shard
    # group, the ranks holding the same experts (the expert-data group)


class SliceRecord(Protocol):
    """What a split knows of its slices (`TensorSplit`, `ExpertSplit`): which parameters are
    slices, their whole shapes, and how a whole value is had from the slices (a collective
    over the split's group) or a slice from a whole value. Export and whole-tensor loads ask
    every record a model has; each answers only for its own parameters."""

    def whole_value(self, param: Any, local: torch.Tensor) -> torch.Tensor: ...

    def whole_shape(self, param: Any) -> tuple[int, ...] | None: ...

    def local_part(self, param: Any, whole: torch.Tensor) -> torch.Tensor: ...


def whole_value(records: Sequence[SliceRecord], param: Any, local: torch.Tensor) -> torch.Tensor:
    """`local`, or the whole tensor of which it is this rank's slice (a collective over the
    group of the record that owns `param`; every rank calls it for the same tensors)."""
    for record in records:
        local = record.whole_value(param, local)
    return local


def whole_shape(
    records: Sequence[SliceRecord], param: Any, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """`param`'s whole shape (`shape`, its own, when no record splits it)."""
    for record in records:
        found = record.whole_shape(param)
        if found is not None:
            return found
    return shape


def local_part(records: Sequence[SliceRecord], param: Any, whole: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a whole value of `param` (`whole` when no record splits it)."""
    for record in records:
        whole = record.local_part(param, whole)
    return whole
