"""Lay out a model's parameters in flat groups, as the stage's plan says."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from zerodp.partition.blocks import claim_units, plan_block_units
from zerodp.partition.flat_group import FlatGroup
from zerodp.partition.planner import GroupPlan, ParamInfo, plan_buckets, plan_stage3
from zerodp.partition.slicing import Slicing
from zerodp.torch_internals import direct_parameters


@dataclass
class ModelLayout:
    """A model's flat groups, in reduction order, and each module's direct parameters."""

    groups: list[FlatGroup]
    module_params: dict[nn.Module, list[nn.Parameter]]


def describe_params(
    module: nn.Module,
    trainable_groups: dict[int, int],
    slicing: Mapping[int, Slicing] | None = None,
) -> tuple[list[nn.Parameter], list[ParamInfo], dict[nn.Module, list[nn.Parameter]]]:
    """Every distinct parameter with its metadata, and each module's direct parameters.

    `slicing`: id(param) -> its kind of slice, for the parameters that are slices.
    """
    slicing = slicing or {}
    params: list[nn.Parameter] = []
    infos: list[ParamInfo] = []
    owner: dict[int, int] = {}
    module_params: dict[nn.Module, list[nn.Parameter]] = {}
    for module_index, sub in enumerate(module.modules()):
        direct = direct_parameters(sub)
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
                slicing=slicing.get(id(param), Slicing.WHOLE),
            )
        )
    return params, infos, module_params


def plan_units(
    module: nn.Module, max_numel: int, excluded: set[nn.Module] | None = None
) -> dict[nn.Module, nn.Module]:
    """Stage 3 units by size (`stage3_unit_numel`): module -> the outermost module whose
    subtree is gathered as one.

    A module other than the root becomes a unit when it runs a forward of its
    own, its subtree holds at most `max_numel` parameter elements (each shared
    parameter counted once) and no module of its subtree is in `excluded`
    (leaf modules, which have a gathering rule of their own; modules inside a
    leaf may be units, which the leaf gathers with the rest of its subtree). The
    outermost such module wins; every module inside it maps to it. `max_numel`
    0: none.
    """
    if max_numel <= 0:
        return {}
    candidates = [m for m in module.modules() if m is not module]
    return claim_units(candidates, max_numel, excluded or set())


@dataclass(frozen=True)
class UnitRule:
    """How stage 3 groups modules into units (see docs/stage3.md#units).

    `numel` > 0 (`stage3_unit_numel`) takes precedence: units by size. Otherwise
    `kind` "blocks" makes each repeated block of at most `max_block_numel`
    elements one unit (the engine passes the smaller of `stage3_prefetch_bucket_size`
    and `stage3_max_live_parameters`: a unit gathered whole then holds no more than
    prefetching may already hold), and "modules" keeps one group per module.
    """

    kind: str = "modules"
    numel: int = 0
    max_block_numel: int = 0

    def plan(self, module: nn.Module, excluded: set[nn.Module]) -> dict[nn.Module, nn.Module]:
        if self.numel > 0:
            return plan_units(module, self.numel, excluded)
        if self.kind == "blocks":
            return plan_block_units(module, self.max_block_numel, excluded)
        return {}


def _apply_units(
    module_params: dict[nn.Module, list[nn.Parameter]], unit_of: dict[nn.Module, nn.Module]
) -> dict[nn.Module, list[nn.Parameter]]:
    """Each unit lists its whole subtree's parameters; the modules inside it list none."""
    result: dict[nn.Module, list[nn.Parameter]] = {}
    for sub, direct in module_params.items():
        target = unit_of.get(sub, sub)
        listed = result.setdefault(target, [])
        seen = {id(p) for p in listed}
        listed.extend(p for p in direct if id(p) not in seen)
        result.setdefault(sub, [])
    return result


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
    owns_full: bool = False,
    presharded: list[FlatGroup] | None = None,
    units: UnitRule | None = None,
    unit_excluded: set[nn.Module] | None = None,
    slicing: Mapping[int, Slicing] | None = None,
    expert_places: tuple[int, int] | None = None,
) -> ModelLayout:
    """Flat groups for `module`; `trainable_groups` maps id(param) to its optimizer group.

    Stages 0-2 lay out trainable parameters only (frozen ones stay as they
    are); stage 3 shards frozen parameters too, since they take memory alike.
    `owns_full` (stage 0) makes each rank's optimizer own whole groups.
    `units` (stage 3): see `UnitRule`; a unit's sharded parameters share one
    flat group (per dtype, optimizer param group and trainability). `slicing`: id(param) ->
    the kind of slice it is (tensor or expert), which never share a group with whole
    parameters or each other. `expert_places`: (world size, rank) of the expert-data group,
    which expert slices are sharded over (the shard group's `world_size`, `rank` otherwise).
    """
    params, infos, module_params = describe_params(module, trainable_groups, slicing)
    if shard_params and units is not None:
        unit_of = units.plan(module, unit_excluded or set())
        if unit_of:
            index_of = {m: i for i, m in enumerate(module.modules())}
            modules = list(index_of)
            infos = [
                dataclasses.replace(
                    info, owner=index_of[unit_of.get(modules[info.owner], modules[info.owner])]
                )
                for info in infos
            ]
            module_params = _apply_units(module_params, unit_of)
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
        key=lambda pair: pair[0].reduction_key,
        reverse=True,
    )
    groups = []
    for plan, adopted in ordered:
        names = [infos[i].name for i in plan.members]
        param_group = infos[plan.members[0]].param_group
        if adopted is None:
            persistent = plan.persistent or not shard_params
            kind = infos[plan.members[0]].slicing
            places = (world_size, rank)
            if kind is Slicing.EXPERT:
                if expert_places is None:  # pragma: no cover - the engine passes them
                    raise RuntimeError("internal error: expert slices without expert places")
                places = expert_places
                # Alone in its expert-data group (E = Z x S), a rank's shard of its experts
                # is all of them: kept whole, with the shard a view of it, rather than copied
                # into a full buffer before each use and held twice while in use. Only here:
                # a world of one at stage 3 keeps its groups sharded, since parameter offload
                # moves the shards of sharded groups (expert parallelism refuses offload).
                persistent = persistent or places[0] == 1
            flat = FlatGroup(
                params=[params[i] for i in plan.members],
                names=names,
                world_size=places[0],
                rank=places[1],
                device=device,
                param_group_index=param_group,
                persistent=persistent,
                owns_full=owns_full and persistent,
                slicing=kind,
            )
        else:  # built already sharded (zero.Init): adopt it as it is
            flat = adopted
            flat.names, flat.param_group_index = names, param_group
        groups.append(flat)
    return ModelLayout(groups=groups, module_params=module_params)
