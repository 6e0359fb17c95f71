"""The values a DeepSpeed checkpoint holds, by parameter name and element range.

Two sources with one surface: `ZeroSource` reads the per-rank optimizer
files of a ZeRO stage 1-3 checkpoint through the partition layout, and
`UniversalSource` reads the per-parameter files of a universal checkpoint.
Both answer:

- `optimizer`: what every rank shares (param groups, loss scaler, each
  parameter's Adam step);
- `check(wanted)`: every file the wanted ranges need is there and holds
  what the layout says (read now, kept memory-mapped);
- `fill(wanted)`: copy the fp32 masters and Adam moments of the wanted
  ranges into their destinations, file by file, counting every element.

A rank opens only the files that hold some of what it owns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zerodp.checkpoint_io.deepspeed.files import (
    UNIVERSAL_OPTIMIZER,
    DeepSpeedFiles,
    DeepSpeedFormat,
)
from zerodp.checkpoint_io.deepspeed.layout import DeepSpeedLayout
from zerodp.checkpoint_io.deepspeed.records import (
    ModelStates,
    OptimizerStates,
    read_optimizer_states,
    step_of,
)
from zerodp.checkpoint_io.deepspeed.unpickle import DeepSpeedRecord, read_pickle
from zerodp.errors import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Wanted:
    """Elements [start, end) of DeepSpeed parameter `name`, and where each value goes.

    `destinations` maps "fp32" (the master weights) and, with optimizer state,
    "exp_avg" and "exp_avg_sq" to 1-D tensors of end - start elements.
    """

    name: str
    start: int
    end: int
    destinations: dict[str, torch.Tensor]
    filled: dict[str, int] = field(default_factory=dict)

    def put(self, key: str, param_start: int, values: torch.Tensor) -> None:
        """Copy `values` (elements from `param_start` on) where they overlap this range."""
        destination = self.destinations.get(key)
        if destination is None:
            return
        lo = max(self.start, param_start)
        hi = min(self.end, param_start + values.numel())
        if lo >= hi:
            return
        destination[lo - self.start : hi - self.start].copy_(
            values[lo - param_start : hi - param_start]
        )
        self.filled[key] = self.filled.get(key, 0) + hi - lo

    def check_complete(self, source: str) -> None:
        for key in self.destinations:
            if self.filled.get(key, 0) != self.end - self.start:
                raise CheckpointError(
                    f"{source} holds {self.filled.get(key, 0)} of the {self.end - self.start} "
                    f"elements of '{self.name}' [{self.start}, {self.end}) for '{key}'; the "
                    "checkpoint is incomplete or damaged"
                )


@dataclass(frozen=True)
class SharedOptimizerState:
    """What every rank's optimizer file shares."""

    param_groups: list[dict[str, Any]] | None  # None: an elastic checkpoint saved none
    loss_scaler: DeepSpeedRecord | None
    steps: dict[str, int]  # a trainable parameter's Adam step
    group_members: list[list[str]]  # per param group: its parameters


class Source(Protocol):
    optimizer: SharedOptimizerState

    def check(self, wanted: list[Wanted]) -> None: ...

    def fill(self, wanted: list[Wanted]) -> None: ...


def open_source(files: DeepSpeedFiles, model: ModelStates) -> Source:
    if files.format is DeepSpeedFormat.UNIVERSAL:
        return UniversalSource(files, model)
    return ZeroSource(files, model)


def _numels(model: ModelStates) -> list[list[tuple[str, int]]]:
    return [
        [(name, int(torch.Size(shape).numel())) for name, shape in group.items()]
        for group in model.flat_groups
    ]


def _members(
    model: ModelStates, groups: list[dict[str, Any]] | None, where: str
) -> list[list[str]]:
    """Per torch param group, its parameters (through the flat groups it lists)."""
    flat = [list(group) for group in model.flat_groups]
    if groups is None:  # one flat group per param group (elastic stage 1-2 checkpoints)
        return flat
    members = []
    for index, group in enumerate(groups):
        held = group.get("params") if isinstance(group, dict) else None
        if not isinstance(held, list) or not all(
            isinstance(i, int) and 0 <= i < len(flat) for i in held
        ):
            raise CheckpointError(
                f"{where}: optimizer param group {index} does not list flat groups 0.."
                f"{len(flat) - 1}; the file is damaged"
            )
        members.append([name for i in held for name in flat[i]])
    return members


class ZeroSource:
    """A ZeRO stage 1-3 checkpoint's optimizer files, read through `DeepSpeedLayout`."""

    def __init__(self, files: DeepSpeedFiles, model: ModelStates) -> None:
        self.files = files
        self.world_size = len(files.optim_files)
        if model.dp_world_size != self.world_size:
            raise CheckpointError(
                f"'{model.path}' says {model.dp_world_size} data-parallel ranks saved the "
                f"checkpoint, but '{files.folder}' has {self.world_size} optimizer files; it "
                "is incomplete or mixes two saves"
            )
        first = read_optimizer_states(files.optim_files[0])
        if len(first.partitions) != len(model.flat_groups):
            raise CheckpointError(
                f"'{first.path}' has {len(first.partitions)} flat groups, '{model.path}' lists "
                f"{len(model.flat_groups)}; the files do not belong together"
            )
        numels = _numels(model)
        if files.format is DeepSpeedFormat.ZERO3:
            self.layout = DeepSpeedLayout.stage3(numels, self.world_size)
        else:
            self.layout = DeepSpeedLayout.stage12(
                numels, self.world_size, first.partition_numels, first.alignment_paddings
            )
        self._opened: dict[int, OptimizerStates] = {0: first}
        self.optimizer = SharedOptimizerState(
            param_groups=first.param_groups,
            loss_scaler=first.loss_scaler,
            steps={
                name: step_of(first.states[self.layout.group_of(name)], f"'{first.path}'")
                for name in self.layout.names
                if "step" in first.states[self.layout.group_of(name)]
            },
            group_members=_members(model, first.param_groups, f"'{first.path}'"),
        )

    def _ranks(self, wanted: Iterable[Wanted]) -> list[int]:
        ranks: set[int] = set()
        for item in wanted:
            if item.destinations:
                ranks |= self.layout.ranks_holding(item.name, item.start, item.end)
        return sorted(ranks)

    def _file(self, rank: int) -> OptimizerStates:
        if rank not in self._opened:
            self._opened[rank] = read_optimizer_states(self.files.optim_files[rank])
        return self._opened[rank]

    def check(self, wanted: list[Wanted]) -> None:
        with_moments = any(key in item.destinations for item in wanted for key in MOMENTS)
        for rank in self._ranks(wanted):
            opened = self._file(rank)
            self.layout.check_against(rank, opened.usable, f"'{opened.path}'")
            for group, state in enumerate(opened.states if with_moments else []):
                for key in MOMENTS:
                    value = state.get(key)
                    if not isinstance(value, torch.Tensor) or value.numel() < opened.usable[group]:
                        raise CheckpointError(
                            f"'{opened.path}': flat group {group} has no Adam '{key}' of "
                            f"{opened.usable[group]} elements; zerodp reads the state of "
                            "DeepSpeed's Adam and AdamW (or pass load_optimizer_states=False)"
                        )

    def fill(self, wanted: list[Wanted]) -> None:
        by_name: dict[str, list[Wanted]] = {}
        for item in wanted:
            by_name.setdefault(item.name, []).append(item)
        for rank in self._ranks(wanted):
            opened = self._file(rank)
            for name, items in by_name.items():
                for piece in self.layout.fragments(name):
                    if piece.rank != rank:
                        continue
                    span = slice(piece.start, piece.start + piece.numel)
                    values = {"fp32": opened.partitions[piece.group][span]}
                    for key in MOMENTS:
                        moment = opened.states[piece.group].get(key)
                        if isinstance(moment, torch.Tensor):
                            values[key] = moment.reshape(-1)[span]
                    for item in items:
                        for key, value in values.items():
                            item.put(key, piece.param_start, value)
            self._opened.pop(rank, None)  # done with this file: let its mapping go
        for item in wanted:
            item.check_complete(f"'{self.files.folder}'")


class UniversalSource:
    """A universal checkpoint: `zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt` per parameter."""

    def __init__(self, files: DeepSpeedFiles, model: ModelStates) -> None:
        self.folder = files.universal_folder
        common = read_pickle(self.folder / UNIVERSAL_OPTIMIZER)
        if not isinstance(common, dict):
            raise CheckpointError(f"'{self.folder / UNIVERSAL_OPTIMIZER}' is not DeepSpeed's dict")
        groups = common.get("param_groups")
        if not isinstance(groups, list):
            groups = None
        scaler = common.get("loss_scaler")
        self._names = list(model.trainable_shapes)
        self._model = model
        self._common = common
        self._values: dict[tuple[str, str], torch.Tensor] = {}
        self.optimizer = SharedOptimizerState(
            param_groups=groups,
            loss_scaler=scaler if isinstance(scaler, DeepSpeedRecord) else None,
            steps={n: s for n in self._names if (s := self._step(n)) is not None},
            group_members=_members(model, groups, f"'{self.folder / UNIVERSAL_OPTIMIZER}'"),
        )

    def _step(self, name: str) -> int | None:
        """The parameter's step: its step.pt, or (stage 3 sources) its flat group's state."""
        path = self.folder / name / "step.pt"
        if path.is_file():
            return step_of({"step": read_pickle(path)}, f"'{path}'")
        inner = self._common.get("optimizer_state_dict")
        state = inner.get("state") if isinstance(inner, dict) else None
        group = next(i for i, g in enumerate(self._model.flat_groups) if name in g)
        if not isinstance(state, dict) or not isinstance(state.get(group), dict):
            return None
        if "step" not in state[group]:
            return None
        return step_of(state[group], f"'{self.folder / UNIVERSAL_OPTIMIZER}'")

    def _value(self, name: str, key: str) -> torch.Tensor:
        cached = self._values.get((name, key))
        if cached is not None:
            return cached
        path = self.folder / name / f"{key}.pt"
        data = read_pickle(path)
        tensor = data.get("param") if isinstance(data, dict) else data
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"'{path}' holds no tensor; the universal checkpoint is damaged")
        numel = int(torch.Size(self._model.trainable_shapes[name]).numel())
        if tensor.numel() != numel:
            raise CheckpointError(
                f"'{path}' holds {tensor.numel()} elements, '{name}' has {numel}; DeepSpeed's "
                "converter padded or split it in a way zerodp does not read"
            )
        flat = tensor.reshape(-1)
        self._values[(name, key)] = flat
        return flat

    def check(self, wanted: list[Wanted]) -> None:
        for item in wanted:
            for key in item.destinations:
                self._value(item.name, key)

    def fill(self, wanted: list[Wanted]) -> None:
        for item in wanted:
            for key in item.destinations:
                item.put(key, 0, self._value(item.name, key))
            item.check_complete(f"'{self.folder}'")
        self._values.clear()


def module_value(model: ModelStates, name: str) -> torch.Tensor | None:
    """A parameter's or buffer's tensor as the module state dict saved it (not at stage 3)."""
    value = model.module.get(name)
    return value if isinstance(value, torch.Tensor) and value.numel() > 0 else None


def frozen_value(models: list[ModelStates], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A frozen parameter's whole value: from the module, or its stage 3 fragments of every rank."""
    numel = int(torch.Size(shape).numel())
    whole = module_value(models[0], name)
    if whole is None:
        whole = models[0].frozen_fragments.get(name)
    if whole is not None and whole.numel() == numel:
        return whole.reshape(shape)
    pieces = [m.frozen_fragments.get(name) for m in models]
    if any(p is None for p in pieces):
        raise CheckpointError(
            f"the checkpoint holds no value for frozen parameter '{name}' (not in the module, "
            "no fragment on every rank); it is incomplete"
        )
    joined = torch.cat([p.reshape(-1) for p in pieces if p is not None])
    if joined.numel() < numel:
        raise CheckpointError(f"the fragments of frozen parameter '{name}' hold too few elements")
    return joined[:numel].reshape(shape)
