"""Lay out a model's parameters in flat groups, as the stage's plan says."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerodp.partition.flat_group import FlatGroup
from zerodp.partition.planner import GroupPlan, ParamInfo, plan_buckets, plan_stage3


@dataclass
class ModelLayout:
    groups: list[FlatGroup]  # in reduction order
    persistent: list[bool]  # per group: stays gathered (stage 3), or is never sharded
    module_params: dict[nn.Module, list[nn.Parameter]]  # each module's direct parameters

    def group_of(self, param: nn.Parameter) -> FlatGroup | None:
        if not hasattr(self, "_by_param"):
            self._by_param = {id(p): g for g in self.groups for p in g.params}
        return self._by_param.get(id(param))


def describe_params(
    module: nn.Module, trainable_groups: dict[int, int]
) -> tuple[list[nn.Parameter], list[ParamInfo], dict[nn.Module, list[nn.Parameter]]]:
    """Every distinct parameter with its metadata, and each module's direct parameters."""
    params: list[nn.Parameter] = []
    infos: list[ParamInfo] = []
    owner: dict[int, int] = {}
    module_params: dict[nn.Module, list[nn.Parameter]] = {}
    for module_index, sub in enumerate(module.modules()):
        direct = [p for p in sub._parameters.values() if p is not None]
        module_params[sub] = direct
        for param in direct:
            owner.setdefault(id(param), module_index)
    for index, (name, param) in enumerate(module.named_parameters()):
        params.append(param)
        infos.append(
            ParamInfo(
                index=index,
                name=name,
                numel=param.numel(),
                dtype=param.dtype,
                param_group=trainable_groups.get(id(param), -1),
                trainable=id(param) in trainable_groups,
                owner=owner[id(param)],
            )
        )
    return params, infos, module_params


def build_layout(
    module: nn.Module,
    trainable_groups: dict[int, int],
    *,
    shard_params: bool,
    world_size: int,
    rank: int,
    device: torch.device,
    bucket_numel: int,
    persistence_threshold: int,
    presharded: list[FlatGroup] | None = None,
) -> ModelLayout:
    """Flat groups for `module`; `trainable_groups` maps id(param) to its optimizer group.

    Stages 0-2 lay out trainable parameters only (frozen ones stay as they
    are); stage 3 shards frozen parameters too, since they take memory alike.
    """
    params, infos, module_params = describe_params(module, trainable_groups)
    position = {id(p): i for i, p in enumerate(params)}
    existing: list[tuple[GroupPlan, FlatGroup | None]] = []
    for flat in presharded or []:
        members = tuple(position[id(p)] for p in flat.params)
        existing.append((GroupPlan(members, persistent=False), flat))
    taken = {i for plan, _ in existing for i in plan.members}
    remaining = [i for i in infos if i.index not in taken]
    if shard_params:
        plans = plan_stage3(remaining, persistence_threshold, bucket_numel)
    else:
        plans = plan_buckets([i for i in remaining if i.trainable], bucket_numel, persistent=True)
    ordered = sorted(
        [(plan, None) for plan in plans] + existing,
        key=lambda pair: pair[0].last_index,
        reverse=True,
    )
    groups = []
    for index, (plan, adopted) in enumerate(ordered):
        names = [infos[i].name for i in plan.members]
        param_group = infos[plan.members[0]].param_group
        if adopted is None:
            flat = FlatGroup(
                index=index,
                params=[params[i] for i in plan.members],
                names=names,
                world_size=world_size,
                rank=rank,
                device=device,
                param_group_index=param_group,
                separate_shard=shard_params and not plan.persistent,
            )
        else:  # built already sharded (zero.Init): adopt it as it is
            flat = adopted
            flat.index, flat.names, flat.param_group_index = index, names, param_group
        groups.append(flat)
    plans = [plan for plan, _ in ordered]
    return ModelLayout(
        groups=groups,
        persistent=[plan.persistent for plan in plans],
        module_params=module_params,
    )
