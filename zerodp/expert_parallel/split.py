"""Splitting a model's experts over an EP group, and the record of it (`split_experts`).

`split_experts` checks everything before anything changes (every rank checks
the same model, so every rank raises the same `ConfigError` without a
collective):

- the plan finds the experts modules and their experts-first tensors
  (`zerodp.expert_parallel.plan`);
- each module's N experts divide by E;
- an expert tensor is not shared with a module that is not an experts module
  (tied weights would be split in one place and whole in another).

Then, on each rank at place e of the group, every expert tensor keeps experts
[e * n, (e + 1) * n) only (a copy of that slice in the same parameter object, so
whatever holds the parameter, an optimizer built before `initialize` included,
still holds it; the whole tensor's storage is freed); each experts module keeps n as its expert
count and takes its `ExpertParallel` class (`zerodp.expert_parallel.layers`).
The parameter names stay the model's own: checkpoints and `from_pretrained`
read the whole tensors under them (`ExpertSplit.whole_value`). The model must be
whole and the same on every rank of the group before (the engine takes it from
rank 0), so the slices are those of one model. There is no way back: a split
model is split for good.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zerodp.comm import Comm
from zerodp.errors import ConfigError
from zerodp.expert_parallel.expert_group import ExpertGroup
from zerodp.expert_parallel.layers import make_expert_parallel
from zerodp.expert_parallel.plan import ExpertsModule, find_experts, read_plan
from zerodp.expert_parallel.record import ExpertSlice, ExpertSplit, ExpertTensor
from zerodp.parallel.expert_slices import held_experts

AUTOEP_KEY = "expert_parallel.autoep_size"
Owners = dict[nn.Parameter, list[tuple[str, nn.Module, str]]]


def split_experts(
    module: nn.Module,
    size: int,
    rank_in_group: int,
    comm: Comm,
    patterns: Sequence[str] | None,
) -> ExpertSplit:
    """Split `module`'s experts over an EP group of `size` ranks; this rank is at place
    `rank_in_group` of `comm` (the group's `Comm`). `patterns`: names of experts modules
    (`expert_parallel.plan`), or None for the model's own plan.

    Raises `ConfigError` naming the fix, changing nothing, when the model cannot be split
    so. With `size` 1 nothing changes: the record says every expert is held here.
    """
    group = ExpertGroup(comm, rank_in_group, size)
    experts = find_experts(module, read_plan(module, patterns))
    owners = _owners(module)
    problems = _count_problems(experts, size) + _sharing_problems(experts, owners)
    if problems:
        raise ConfigError(
            f"{AUTOEP_KEY} {size} cannot split the experts of {type(module).__name__}: "
            + "; ".join(problems)
        )
    return _apply(experts, owners, group)


def _owners(module: nn.Module) -> Owners:
    """Every (module name, module, attribute) that holds each parameter directly."""
    owners: Owners = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for attribute, param in sub._parameters.items():
            if param is not None:
                owners.setdefault(param, []).append((name, sub, attribute))
    return owners


def _count_problems(experts: list[ExpertsModule], size: int) -> list[str]:
    problems = []
    for found in experts:
        count = found.num_experts
        if count % size:
            fits = [d for d in range(2, count + 1) if count % d == 0]
            problems.append(
                f"'{found.name}' has {count} experts ({found.name}.{found.count_attribute}), not "
                f"divisible by {size}: use an {AUTOEP_KEY} that divides {count} "
                f"({', '.join(map(str, fits))})"
            )
    return problems


def _sharing_problems(experts: list[ExpertsModule], owners: Owners) -> list[str]:
    """An expert tensor may be tied only to expert tensors of experts modules alike."""
    held = {(id(f.module), a): f for f in experts for a in f.tensors}
    problems = []
    for found in experts:
        for attribute in found.tensors:
            param = found.module._parameters[attribute]
            for owner_name, owner, owner_attribute in owners.get(param, []):  # type: ignore[arg-type]
                other = held.get((id(owner), owner_attribute))
                if other is None or other.num_experts != found.num_experts:
                    where = f"{owner_name}.{owner_attribute}" if owner_name else owner_attribute
                    problems.append(
                        f"'{found.name}.{attribute}' is shared with '{where}' (tied weights), "
                        "which is not an expert tensor of the same number of experts: untie them"
                    )
    return problems


@torch.no_grad()
def _apply(experts: list[ExpertsModule], owners: Owners, group: ExpertGroup) -> ExpertSplit:
    modules: dict[str, ExpertSlice] = {}
    tensors: dict[str, ExpertTensor] = {}
    by_param: dict[nn.Parameter, ExpertTensor] = {}
    done: set[nn.Parameter] = set()  # split already (a tied tensor is split once)
    for found in experts:
        kept = held_experts(found.num_experts, group.size, group.rank)
        held = ExpertSlice(found.num_experts, len(kept), kept.start)
        modules[found.name] = held
        for attribute in found.tensors:
            whole = found.module._parameters[attribute]
            if whole is None:  # pragma: no cover - found only among present parameters
                raise RuntimeError(f"internal error: '{found.name}.{attribute}' vanished")
            if whole in done:
                continue
            record = ExpertTensor(f"{found.name}.{attribute}", tuple(whole.shape), held)
            done.add(whole)
            by_param[whole] = record
            if group.size > 1:
                _keep_slice(whole, held)
            for owner_name, _owner, owner_attribute in owners[whole]:
                name = f"{owner_name}.{owner_attribute}" if owner_name else owner_attribute
                tensors[name] = record
        if group.size > 1:
            make_expert_parallel(found.module, group, held, found.count_attribute, found.tensors)
    return ExpertSplit(group, modules, tensors, by_param)


def _keep_slice(whole: nn.Parameter, held: ExpertSlice) -> None:
    """`whole` keeps `held`'s experts only, in place: the same parameter object, so an
    optimizer or anything else built on the model's parameters before the split still holds
    it (a copy of the slice: the whole tensor's storage is freed)."""
    whole.data = whole.data.narrow(0, held.first_expert, held.local_experts).clone()
