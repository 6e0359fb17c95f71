"""Flat-buffer layout and sharding: where each parameter lives in a flat buffer.

`layout` is pure arithmetic (offsets, padding, shard ranges); `flat_group`
turns a layout into tensors whose parameters are views of one flat buffer.
Nothing here issues a collective.
"""

from zerodp.partition.flat_group import FlatGroup
from zerodp.partition.layout import FlatLayout, ParamSlot, ShardOverlap
from zerodp.partition.slicing import Slicing

__all__ = ["FlatGroup", "FlatLayout", "ParamSlot", "ShardOverlap", "Slicing"]
