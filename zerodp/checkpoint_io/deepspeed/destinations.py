"""Where each DeepSpeed value goes in this engine, planned and checked before anything changes.

Parameters are matched by name (a tied parameter by any of its names, and
DeepSpeed's `shared_params`), shapes must agree. For a parameter this
engine trains, the rank's owned range of it is filled in place: the fp32
master (the optimizer parameter) and the Adam moments, read straight from
DeepSpeed's partitions (`sources.Wanted`). Any other parameter (frozen here,
or frozen in the DeepSpeed run) is restored whole on every rank
(`WholeValue`), from the fp32 master when DeepSpeed trained it, else from
the module's saved weights.

State a fresh torch optimizer creates only at its first step is made here as
new tensors (`new_state`) and attached by `attach` once the load goes ahead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from zerodp.checkpoint_io.deepspeed.records import ModelStates
from zerodp.checkpoint_io.deepspeed.sources import MOMENTS, Wanted
from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.checkpoint_io.tensors import owned_chunk, param_entries
from zerodp.errors import CheckpointError
from zerodp.group_state import GroupState


@dataclass
class WholeValue:
    """A parameter restored whole: `write(value)` puts the full value everywhere it lives."""

    name: str  # DeepSpeed's name
    shape: tuple[int, ...]
    write: Callable[[torch.Tensor], None]
    from_master: bool  # DeepSpeed trained it: read its fp32 master (else the module's weights)
    wanted: Wanted | None = None  # where its master is read into, when `from_master`


@dataclass
class ParamDestinations:
    """Everything this rank restores into its parameters and optimizer state."""

    in_place: list[Wanted] = field(default_factory=list)
    whole: list[WholeValue] = field(default_factory=list)
    new_state: dict[nn.Parameter, dict[str, torch.Tensor]] = field(default_factory=dict)
    steps: dict[GroupState, int] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # this model's name -> DeepSpeed's

    @property
    def wanted(self) -> list[Wanted]:
        """Every range read from the optimizer files (masters of whole values included)."""
        return self.in_place + [w.wanted for w in self.whole if w.wanted is not None]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        for param, state in self.new_state.items():
            optimizer.state[param] = state


def match_names(module: nn.Module, model: ModelStates) -> dict[str, str]:
    """This model's parameter name (first, as `named_parameters()` gives it) -> DeepSpeed's.

    Raises `CheckpointError` for a parameter either side lacks, naming both lists.
    """
    saved = {**model.trainable_shapes, **model.frozen_shapes}
    names_of: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    matched: dict[str, str] = {}
    missing = []
    for names in names_of.values():
        candidates = [model.shared_params.get(n, n) for n in names]
        found = next((c for c in candidates if c in saved), None)
        if found is None:
            missing.append(names[0])
        else:
            matched[names[0]] = found
    extra = sorted(set(saved) - set(matched.values()))
    if missing or extra:
        raise CheckpointError(
            f"the DeepSpeed checkpoint '{model.path.parent}' is for a different model: this "
            f"model's parameters {missing[:5]} are not in it, its parameters {extra[:5]} are not "
            "in this model; build the model the checkpoint was saved from"
        )
    return matched


def plan_destinations(
    subject: CheckpointSubject, model: ModelStates, with_optimizer: bool
) -> ParamDestinations:
    """This rank's destinations; raises `CheckpointError` before anything is changed."""
    names = match_names(subject.module, model)
    trainable = model.trainable_shapes
    plan = ParamDestinations(names=names)
    for entry in param_entries(subject):
        ds_name = names[entry.name]
        state, position = entry.state, entry.position
        shape = (
            tuple(state.flat.layout.slots[position].shape) if state else tuple(entry.param.shape)
        )
        saved_shape = trainable.get(ds_name, model.frozen_shapes.get(ds_name))
        if saved_shape != shape:
            raise CheckpointError(
                f"the DeepSpeed checkpoint is for a different model: parameter '{entry.name}' "
                f"has shape {shape} here and {saved_shape} in it; build the model the "
                "checkpoint was saved from"
            )
        ds_trained = ds_name in trainable
        if state is not None and state.optim is not None:
            if ds_trained:
                plan.in_place.append(
                    _in_place(subject, plan, state, position, ds_name, with_optimizer)
                )
                continue
            if with_optimizer:
                raise CheckpointError(
                    f"parameter '{entry.name}' is trained here but was frozen in the DeepSpeed "
                    "run, so the checkpoint has no optimizer state for it; freeze it as the run "
                    "did, or pass load_optimizer_states=False"
                )
        plan.whole.append(_whole(entry.param, state, position, ds_name, shape, ds_trained))
    return plan


def _in_place(
    subject: CheckpointSubject,
    plan: ParamDestinations,
    state: GroupState,
    position: int,
    ds_name: str,
    with_optimizer: bool,
) -> Wanted:
    flat, optim = state.flat, state.optim
    if optim is None:  # pragma: no cover - the caller checked
        raise RuntimeError("internal error: no optimizer parameter")
    if flat.owns_full:
        start, end = 0, flat.layout.slots[position].numel
    else:
        overlap = flat.layout.overlap(position, flat.rank)
        start, end = (0, 0) if overlap is None else (overlap.param_start, overlap.param_end)
    destinations: dict[str, torch.Tensor] = {}
    if end > start:
        master = owned_chunk(optim.param.detach(), state, position)
        if master is not None:
            destinations["fp32"] = master
        if with_optimizer:
            slots = _optimizer_state(subject, plan, optim.param)
            for key in MOMENTS:
                chunk = owned_chunk(slots[key], state, position)
                if chunk is not None:
                    destinations[key] = chunk
    return Wanted(ds_name, start, end, destinations)


def _optimizer_state(
    subject: CheckpointSubject, plan: ParamDestinations, param: nn.Parameter
) -> dict[str, torch.Tensor]:
    """The optimizer's state of `param`: its own, or new tensors for a fresh optimizer."""
    existing = subject.optimizer.state.get(param)
    if existing:
        if not all(isinstance(existing.get(k), torch.Tensor) for k in (*MOMENTS, "step")):
            raise CheckpointError(
                f"this engine's optimizer ({type(subject.optimizer).__name__}) keeps "
                f"{sorted(existing)} per parameter, not Adam's moments; build the engine with "
                "Adam or AdamW as the DeepSpeed run had, or pass load_optimizer_states=False"
            )
        return existing
    if param not in plan.new_state:
        group = next(
            g for g in subject.optimizer.param_groups if any(p is param for p in g["params"])
        )
        on_device = group.get("fused") or group.get("capturable")
        plan.new_state[param] = {
            "step": torch.zeros(
                (), dtype=torch.float32, device=param.device if on_device else "cpu"
            ),
            **{k: torch.zeros_like(param, memory_format=torch.preserve_format) for k in MOMENTS},
        }
    return plan.new_state[param]


def _whole(
    param: nn.Parameter,
    state: GroupState | None,
    position: int,
    ds_name: str,
    shape: tuple[int, ...],
    from_master: bool,
) -> WholeValue:
    if state is not None:

        def write(value: torch.Tensor) -> None:
            state.write_param(position, value)

    else:

        def write(value: torch.Tensor) -> None:
            with torch.no_grad():
                param.data.copy_(value.reshape(param.shape))

    value = WholeValue(ds_name, shape, write, from_master)
    if from_master:
        numel = int(torch.Size(shape).numel())
        value.wanted = Wanted(ds_name, 0, numel, {"fp32": torch.empty(numel, dtype=torch.float32)})
    return value


def plan_steps(subject: CheckpointSubject, plan: ParamDestinations, steps: dict[str, int]) -> None:
    """Each trainable group's Adam step: the step DeepSpeed kept for its parameters."""
    for state in subject.groups.trainable:
        if state.optim is None:
            continue
        names = [plan.names[n] for n in state.names if n in plan.names]
        missing = [n for n in names if n not in steps]
        if missing:
            raise CheckpointError(
                f"the DeepSpeed checkpoint has no Adam step count for {missing[:4]}: its "
                "optimizer was not Adam; pass load_optimizer_states=False to load the weights"
            )
        seen = {steps[n] for n in names}
        if len(seen) > 1:
            raise CheckpointError(
                f"the parameters {state.names[:4]} share one optimizer group here but had "
                f"different step counts {sorted(seen)} in DeepSpeed; put them in separate "
                "param groups as the run did, or pass load_optimizer_states=False"
            )
        if seen:
            plan.steps[state] = seen.pop()


def write_steps(subject: CheckpointSubject, plan: ParamDestinations) -> None:
    for state, step in plan.steps.items():
        if state.optim is not None:
            slots = subject.optimizer.state.get(state.optim.param) or {}
            if isinstance(slots.get("step"), torch.Tensor):
                slots["step"].fill_(float(step))


def check_optimizer_kind(optimizer: torch.optim.Optimizer) -> None:
    """DeepSpeed's ZeRO checkpoints hold Adam state: the engine's optimizer must keep the same."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise CheckpointError(
            f"the DeepSpeed checkpoint holds Adam state (exp_avg, exp_avg_sq, step), which "
            f"{type(optimizer).__name__} does not keep; build the engine with Adam or AdamW, or "
            "pass load_optimizer_states=False to load the weights and counters only"
        )
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise CheckpointError(
            "this engine's Adam uses amsgrad, whose max_exp_avg_sq DeepSpeed's Adam does not "
            "keep; build it without amsgrad, or pass load_optimizer_states=False"
        )
