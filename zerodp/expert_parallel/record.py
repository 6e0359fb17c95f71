"""`ExpertSplit`: the record of which experts a rank holds, and the way back to whole tensors.

Asked by the engine (which parameters are expert slices: they are sharded and
reduced over the expert-data group, not the data ranks), by checkpoints (a
slice's place in its global tensor) and by export (`whole_value`: the slices
gathered back into the model's own whole tensor, a collective over the EP
group). Every name of an expert tensor is recorded, tied names too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerodp.expert_parallel.expert_group import ExpertGroup


@dataclass(frozen=True)
class ExpertSlice:
    """Which experts of an experts module (or of one of its tensors) a rank holds: experts
    [`first_expert`, `first_expert` + `local_experts`) of `global_experts`, along dim 0."""

    global_experts: int
    local_experts: int
    first_expert: int

    @property
    def experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.local_experts)


@dataclass(frozen=True)
class ExpertTensor:
    """One expert tensor: its first name in the model, its whole shape, this rank's slice."""

    name: str
    global_shape: tuple[int, ...]
    slice: ExpertSlice


@dataclass(frozen=True)
class ExpertSplit:
    """What `split_experts` did (see the module docstring).

    `modules`: each experts module's name -> its slice; `tensors`: every name of an
    expert tensor (tied names too) -> its record. `size` is E, `rank` this rank's place
    e in its EP group (it holds experts [e * n, (e + 1) * n) of every experts module).
    """

    group: ExpertGroup
    modules: Mapping[str, ExpertSlice]
    tensors: Mapping[str, ExpertTensor]
    _by_param: Mapping[nn.Parameter, ExpertTensor] = field(repr=False)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def names(self) -> frozenset[str]:
        """Every name of an expert tensor in the split model (tied names too)."""
        return frozenset(self.tensors)

    def is_expert(self, param: Any) -> bool:
        """Whether `param` is an expert slice (a parameter of the split model)."""
        return isinstance(param, nn.Parameter) and param in self._by_param

    def expert_of(self, name: str) -> ExpertTensor | None:
        """The record of the expert tensor named `name` (None: not an expert tensor)."""
        return self.tensors.get(name)

    def whole_value(self, param: Any, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor of which `local` is this rank's slice of expert tensor `param`
        (a parameter of the split model): every rank's slice gathered along dim 0, in expert
        order (a collective over the EP group: every rank calls it, for the same tensors in
        the same order). Any other tensor is returned as it is, without communication."""
        found = self._by_param.get(param) if isinstance(param, nn.Parameter) else None
        return local if found is None else self.whole_value_named(found.name, local)

    def whole_value_named(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """`whole_value` of the expert tensor named `name` (any other name: `local`)."""
        found = self.tensors.get(name)
        if found is None:
            return local
        _check_local(name, found, local)
        local = local.detach().contiguous()
        whole = torch.empty(found.global_shape, dtype=local.dtype, device=local.device)
        self.group.comm.all_gather(whole.view(-1), local.view(-1))
        return whole

    def whole_shape(self, param: Any) -> tuple[int, ...] | None:
        """The whole shape of expert tensor `param` (None: not an expert tensor)."""
        found = self._by_param.get(param) if isinstance(param, nn.Parameter) else None
        return None if found is None else found.global_shape

    def local_part(self, param: Any, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `whole`, a whole value of expert tensor `param` (no
        communication; any other tensor's value is returned as it is)."""
        found = self._by_param.get(param) if isinstance(param, nn.Parameter) else None
        return whole if found is None else self.local_part_named(found.name, whole)

    def local_part_named(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """`local_part` of the expert tensor named `name` (any other name: `whole`)."""
        found = self.tensors.get(name)
        if found is None:
            return whole
        if tuple(whole.shape) != found.global_shape:
            raise ValueError(
                f"'{name}' is a tensor of shape {found.global_shape}; got {tuple(whole.shape)}"
            )
        return whole.narrow(0, found.slice.first_expert, found.slice.local_experts)


def _check_local(name: str, found: ExpertTensor, local: torch.Tensor) -> None:
    expected = (found.slice.local_experts, *found.global_shape[1:])
    if tuple(local.shape) != expected:
        raise ValueError(
            f"'{name}': this rank's slice has shape {expected}, got {tuple(local.shape)}"
        )
