"""A split experts module's class: the model's own class with a forward that dispatches.

A module the plan names keeps its identity, its name, its parameter names and
everything else the model reads from it; only its class changes (as tensor
parallelism's split Linears, and FSDP2's `fully_shard`, change a module's
class) to a subclass generated once per experts class: `ExpertParallel<Name>`,
whose `forward` sends the tokens to their experts' ranks and back
([Note: expert-parallel dispatch]) and runs the original class's forward on the
rows this rank's experts receive. The module stays an instance of its own class
(`isinstance` checks, weight initialisation and output recording still see it),
and its expert count attribute says how many experts it holds here.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from torch import nn

from zerodp.expert_parallel.dispatch import dispatch_experts
from zerodp.expert_parallel.expert_group import ExpertGroup
from zerodp.expert_parallel.record import ExpertSlice

_GENERATED: dict[type[nn.Module], type[nn.Module]] = {}


class ExpertParallelExperts:
    """The part every generated class shares (first in its bases, before the model's class)."""

    expert_group: ExpertGroup
    expert_slice: ExpertSlice
    expert_tensors: tuple[str, ...]
    _expert_signature: inspect.Signature

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        bound = self._expert_signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        hidden_states, top_k_index, top_k_weights = list(bound.arguments.values())[1:]
        module = cast(nn.Module, self)
        own_forward = super().forward  # type: ignore[misc]

        def local_forward(
            rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
        ) -> torch.Tensor:
            out: torch.Tensor = own_forward(rows, index, weights)
            return out

        # Every parameter the module holds, not only its expert tensors: a rank sent no row
        # touches them all, so each gets a gradient on every rank (a norm the plan keeps whole
        # beside the experts too).
        params = list(module.parameters())
        return dispatch_experts(
            hidden_states,
            top_k_index,
            top_k_weights,
            group=self.expert_group,
            experts=self.expert_slice,
            local_forward=local_forward,
            params=params,
        )

    def extra_repr(self) -> str:
        own = super().extra_repr()  # type: ignore[misc]
        held = self.expert_slice
        where = (
            f"experts {held.first_expert}..{held.first_expert + held.local_experts - 1} of "
            f"{held.global_experts} (expert-parallel rank {self.expert_group.rank} of "
            f"{self.expert_group.size})"
        )
        return f"{own}, {where}" if own else where


def expert_parallel_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The generated subclass of experts class `cls` (made once per class)."""
    made = _GENERATED.get(cls)
    if made is None:
        made = cast(
            type[nn.Module],
            type(
                f"ExpertParallel{cls.__name__}",
                (ExpertParallelExperts, cls),
                {
                    "__module__": __name__,
                    "__doc__": f"{cls.__name__}, split over an expert-parallel group.",
                    "_expert_signature": inspect.signature(cls.forward),
                },
            ),
        )
        _GENERATED[cls] = made
    return made


def make_expert_parallel(
    module: nn.Module,
    group: ExpertGroup,
    held: ExpertSlice,
    count_attribute: str,
    tensors: tuple[str, ...],
) -> None:
    """`module` (its expert tensors already this rank's slices) becomes its class's
    `ExpertParallel` subclass and keeps `held.local_experts` as its expert count."""
    module.__class__ = expert_parallel_class(type(module))
    parallel = cast(ExpertParallelExperts, module)
    parallel.expert_group = group
    parallel.expert_slice = held
    parallel.expert_tensors = tensors
    setattr(module, count_attribute, held.local_experts)
