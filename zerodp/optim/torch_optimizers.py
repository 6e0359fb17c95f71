"""The engine's torch optimizers: which param groups each steps, and by which path.

An engine steps one torch optimizer (AdamW, Adafactor, ...) or several: the
config's "Muon" is torch's Muon for the matrices and AdamW for the rest, and
a torch user hands zerodp the same pair as a list (`optimizer=[muon, adamw]`).
Each is one `GroupOptimizer`, stepped on flat shards or on whole tensors as
its class says (`zerodp.optim.tensorwise.selection`); `TorchOptimizers` holds
them all. What users, LR schedulers and checkpoints see is one optimizer: the
only one, or an `OptimizerChain` over all of them, whose param groups are
every member's groups in the engine's order and whose state is one
dictionary the members share.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zerodp.errors import ConfigError
from zerodp.group_state import GroupState
from zerodp.optim.tensorwise import TensorwiseStep, UpdatePath, update_path
from zerodp.torch_internals import init_optimizer_hook_dicts

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


@dataclass
class OptimizerSource:
    """Where one torch optimizer comes from (exactly one of `instance`, `factory`, `cls`),
    and the engine param groups (indices of the resolved specs) it steps."""

    groups: list[int]
    instance: torch.optim.Optimizer | None = None
    factory: OptimizerFactory | None = None
    cls: type[torch.optim.Optimizer] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def known_path(self) -> UpdatePath | None:
        """The path its class takes; None for a factory (known once it has built one)."""
        if self.instance is not None:
            return update_path(type(self.instance))
        if self.cls is not None:
            return update_path(self.cls)
        return None


@dataclass
class GroupOptimizer:
    """One torch optimizer, the path it steps by, and the flat groups it steps."""

    optimizer: torch.optim.Optimizer
    path: UpdatePath
    states: list[GroupState]  # the trainable groups whose parameters it steps


@dataclass
class TorchOptimizers:
    """Every torch optimizer of an engine, and the one optimizer users see."""

    members: list[GroupOptimizer]
    inner: torch.optim.Optimizer  # what users and schedulers see
    tensorwise: TensorwiseStep | None  # the whole tensors, when any member reads them

    @property
    def elementwise(self) -> list[GroupOptimizer]:
        return [p for p in self.members if p.path is UpdatePath.ELEMENTWISE]

    @property
    def tensorwise_optimizers(self) -> list[torch.optim.Optimizer]:
        return [p.optimizer for p in self.members if p.path is UpdatePath.TENSORWISE]


class WholeTensorStepRefusedError(ConfigError):
    """The run's parallel dimensions take no whole-tensor step (the composition table): raised
    by the `make_tensorwise` a caller passes, so that a factory is probed on flat shards."""


def build_torch_optimizers(
    sources: Sequence[OptimizerSource],
    options: Sequence[dict[str, Any]],
    states: list[GroupState],
    make_tensorwise: Callable[[list[GroupState]], TensorwiseStep],
) -> TorchOptimizers:
    """Every source's torch optimizer, on flat shards or on whole tensors.

    `options` are the engine's param groups' settings (all but "params"), by
    index; `states` the trainable groups; `make_tensorwise` plans the whole-tensor
    step for the groups given to it.
    """
    paths = [source.known_path() for source in sources]
    tensorwise: TensorwiseStep | None = None
    if any(path is None for path in paths):  # a factory: offered whole tensors first
        (source,) = sources
        try:
            tensorwise = make_tensorwise(states)
        except WholeTensorStepRefusedError as refused:  # the run's dims take no whole-tensor step
            flat = _flat_params(states, len(options))
            probe = _from_factory(source, _groups(source, options, flat))
            if update_path(type(probe)) is UpdatePath.TENSORWISE:
                raise refused from None
            paths = [UpdatePath.ELEMENTWISE]
        else:
            probe = _from_factory(
                source, _groups(source, options, tensorwise.param_groups(len(options)))
            )
            if update_path(type(probe)) is UpdatePath.TENSORWISE:
                member = GroupOptimizer(probe, UpdatePath.TENSORWISE, states)
                return TorchOptimizers([member], probe, tensorwise)
            tensorwise = None
            paths = [UpdatePath.ELEMENTWISE]
    whole = [s for s, p in zip(sources, paths, strict=True) if p is UpdatePath.TENSORWISE]
    whole_states = [s for s in states if any(s.flat.param_group_index in w.groups for w in whole)]
    if whole_states:
        tensorwise = make_tensorwise(whole_states)
    members = []
    for source, path in zip(sources, paths, strict=True):
        mine = [s for s in states if s.flat.param_group_index in source.groups]
        if path is UpdatePath.TENSORWISE and tensorwise is not None:
            params = tensorwise.param_groups(len(options))
        else:
            params = _flat_params(mine, len(options))
        optimizer = _build(source, _groups(source, options, params))
        if update_path(type(optimizer)) is not path:
            raise TypeError(
                f"the optimizer callable returned a {type(optimizer).__name__} for whole tensors "
                "and another kind for flat shards; return the same class each time"
            )
        members.append(GroupOptimizer(optimizer, path, mine))
    inner = members[0].optimizer if len(members) == 1 else OptimizerChain(members, sources)
    return TorchOptimizers(members, inner, tensorwise)


def _flat_params(states: list[GroupState], num_groups: int) -> list[list[Any]]:
    params: list[list[Any]] = [[] for _ in range(num_groups)]
    for state in states:
        if state.optim is not None:
            params[state.flat.param_group_index].append(state.optim.param)
    return params


def _groups(
    source: OptimizerSource, options: Sequence[dict[str, Any]], params: list[list[Any]]
) -> list[dict[str, Any]]:
    return [{"params": params[index], **options[index]} for index in source.groups]


def _build(source: OptimizerSource, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if source.instance is not None:
        return _repoint(source.instance, groups)
    if source.cls is not None:
        return source.cls(groups, **source.kwargs)
    return _from_factory(source, groups)


def _from_factory(source: OptimizerSource, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if source.factory is None:  # pragma: no cover - sources are built with one of the three
        raise RuntimeError("internal error: an optimizer source without a factory")
    optimizer = source.factory(groups)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"the optimizer callable returned {type(optimizer).__name__}; it must return a "
            "torch.optim.Optimizer built on the param groups it is given"
        )
    return optimizer


def _repoint(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> Any:
    """Keep the user's optimizer object (and any scheduler built on it); step zerodp's
    tensors instead of the model's parameters."""
    if len(optimizer.param_groups) != len(groups):
        raise RuntimeError("internal error: param groups and optimizer groups disagree")
    if optimizer.state:
        warnings.warn(
            "the optimizer passed to zerodp.initialize already has state; zerodp starts it "
            "afresh on its own tensors (load a checkpoint to restore state)",
            stacklevel=4,
        )
    for group, built in zip(optimizer.param_groups, groups, strict=True):
        group["params"] = built["params"]
    optimizer.state = defaultdict(dict)
    return optimizer


class OptimizerChain(torch.optim.Optimizer):
    """Several torch optimizers seen as one (see the module docstring).

    `param_groups` holds the members' own group dictionaries, so a scheduler that
    sets a group's lr sets it for the member; `state` is the one dictionary every
    member reads and writes (their parameters are distinct). `Optimizer.__init__`
    is not called: the chain has no parameters of its own.
    """

    def __init__(self, members: list[GroupOptimizer], sources: Sequence[OptimizerSource]) -> None:
        self.optimizers = [member.optimizer for member in members]
        self.defaults: dict[str, Any] = {}
        # (member, its own group index) for each engine param group, in the engine's order.
        order = sorted(
            (index, number, local)
            for number, source in enumerate(sources)
            for local, index in enumerate(source.groups)
        )
        self._where = [(number, local) for _, number, local in order]
        self._share()
        init_optimizer_hook_dicts(self)

    def _share(self) -> None:
        """The members' group dictionaries in the engine's order, and one state dictionary."""
        self.param_groups = [self.optimizers[n].param_groups[local] for n, local in self._where]
        shared: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for optimizer in self.optimizers:
            shared.update(optimizer.state)
            optimizer.state = shared
        self.state = shared

    @property
    def class_label(self) -> str:
        """The members' classes, as a checkpoint records them ("Muon+AdamW")."""
        return "+".join(type(optimizer).__name__ for optimizer in self.optimizers)

    def group_defaults(self, index: int) -> dict[str, Any]:
        """The defaults of the member that steps param group `index`."""
        return self.optimizers[self._where[index][0]].defaults

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load `state_dict()`'s output: each member gets its own groups and their state."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self._where):
            raise ValueError(
                f"the state dict has {len(groups)} param groups, this optimizer {len(self._where)}"
            )
        for number, optimizer in enumerate(self.optimizers):
            mine = sorted(
                (local, groups[i]) for i, (n, local) in enumerate(self._where) if n == number
            )
            renumber: dict[int, int] = {}
            member_groups = []
            for _, group in mine:
                ids = [renumber.setdefault(i, len(renumber)) for i in group["params"]]
                member_groups.append({**group, "params": ids})
            state = {renumber[i]: v for i, v in state_dict["state"].items() if i in renumber}
            optimizer.load_state_dict({"state": state, "param_groups": member_groups})
        self._share()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "zerodp lays out parameters once, at zerodp.initialize; pass every param group there"
        )

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("zerodp's optimizers take no closure")
        for optimizer in self.optimizers:
            optimizer.step()

    def __repr__(self) -> str:
        return f"OptimizerChain({', '.join(type(o).__name__ for o in self.optimizers)})"
