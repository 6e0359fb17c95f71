"""Which parameters share a flat group: bucketed chunks (stages 0-2) or modules (stage 3).

Pure decisions on parameter metadata; the engine turns each plan into a
`FlatGroup`. Parameters of one group always share a dtype, an optimizer
param group, trainability, and whether they are tensor-parallel slices (the
gradient norm sums the two kinds over different groups). Groups are returned in the order their
gradients are reduced: the reverse of registration order, which is roughly
the order in which backward produces gradients (as in DDP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodp.partition.slicing import Slicing


@dataclass(frozen=True)
class ParamInfo:
    index: int  # position in module.parameters() order
    name: str
    numel: int
    dtype: torch.dtype
    param_group: int  # optimizer param group; -1 for frozen parameters
    trainable: bool
    owner: int  # index of the first module (in module.modules() order) registering it
    slicing: Slicing = Slicing.WHOLE  # a slice of a tensor-parallel or expert-parallel tensor


@dataclass(frozen=True)
class GroupPlan:
    members: tuple[int, ...]  # ParamInfo.index values, in flat-buffer order
    persistent: bool  # the full buffer stays allocated (see [Note: zerodp tensors])

    @property
    def reduction_key(self) -> int:
        """Groups are reduced in descending order of this: when their gradients are complete.

        A backward visits modules roughly in reverse registration order, so a group is
        complete once its earliest-registered member has its gradient. Sorting by the
        earliest member, not the latest, matters for groups that span the model (stage 3's
        persistent groups of small parameters, one per bucket): sorted by their latest
        member they came first, complete only at the end of the backward, and every
        later group's reduction (and its full-size gradient bucket) waited behind them.
        """
        return min(self.members)


def _key(info: ParamInfo) -> tuple[int, torch.dtype, bool, Slicing]:
    return (info.param_group, info.dtype, info.trainable, info.slicing)


def plan_buckets(infos: list[ParamInfo], bucket_numel: int, persistent: bool) -> list[GroupPlan]:
    """Chunk parameters, latest-registered first, into groups of at most `bucket_numel`."""
    open_groups: dict[tuple[int, torch.dtype, bool, Slicing], list[int]] = {}
    open_sizes: dict[tuple[int, torch.dtype, bool, Slicing], int] = {}
    plans: list[GroupPlan] = []
    for info in sorted(infos, key=lambda i: i.index, reverse=True):
        key = _key(info)
        members = open_groups.setdefault(key, [])
        if members and open_sizes[key] + info.numel > bucket_numel:
            plans.append(GroupPlan(tuple(members), persistent))
            members = open_groups[key] = []
            open_sizes[key] = 0
        members.append(info.index)
        open_sizes[key] = open_sizes.get(key, 0) + info.numel
    plans.extend(GroupPlan(tuple(m), persistent) for m in open_groups.values() if m)
    return sorted(plans, key=lambda p: p.reduction_key, reverse=True)


def plan_stage3(
    infos: list[ParamInfo], persistence_threshold: int, bucket_numel: int
) -> list[GroupPlan]:
    """One group per module (and optimizer param group) for large parameters.

    Parameters with fewer than `persistence_threshold` elements stay gathered:
    they are chunked into bucket-sized persistent groups, so that many small
    biases and norms cost a few collectives, not one each.
    """
    small = [i for i in infos if i.numel < persistence_threshold]
    large = [i for i in infos if i.numel >= persistence_threshold]
    by_module: dict[tuple[int, int, torch.dtype, bool, Slicing], list[int]] = {}
    for info in sorted(large, key=lambda i: i.index):
        by_module.setdefault((info.owner, *_key(info)), []).append(info.index)
    plans = [GroupPlan(tuple(members), persistent=False) for members in by_module.values()]
    plans += plan_buckets(small, bucket_numel, persistent=True)
    return sorted(plans, key=lambda p: p.reduction_key, reverse=True)
