"""The hooks through which autograd tells zerodp that a backward is running (every stage).

- On the root module's forward outputs: the first of them to receive a
  gradient in a graph task starts that task's lifecycle, including tasks that
  accumulate no `.grad` (`torch.autograd.grad`).
- On each trainable parameter, before its gradient is accumulated: makes sure
  the task's prologue ran before autograd touches `param.grad`.
- On each trainable parameter, after its gradient is accumulated: hands the
  gradient to the reducer. See [Note: gradient reduction].

Every hook is registered through `BackwardLifecycle.hook` (see
[Note: backward lifecycle]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerodp._tree import grad_tensors_in
from zerodp.backward.lifecycle import BackwardLifecycle
from zerodp.backward.reducer import GradientReducer
from zerodp.group import GroupState


def _nothing(*args: Any) -> None:
    """A hook whose only job is the observation `BackwardLifecycle.hook` adds."""


def install_parameter_hooks(
    states: list[GroupState], lifecycle: BackwardLifecycle, reducer: GradientReducer
) -> list[RemovableHandle]:
    handles = []
    before_accumulate = lifecycle.hook(_nothing)
    for state in states:
        for position, param in enumerate(state.params):

            def after_accumulate(
                param: torch.Tensor, state: GroupState = state, position: int = position
            ) -> None:
                reducer.contribute(state, position, param)  # type: ignore[arg-type]

            handles.append(param.register_hook(before_accumulate))
            handles.append(
                param.register_post_accumulate_grad_hook(lifecycle.hook(after_accumulate))
            )
    return handles


def install_root_hooks(
    root: nn.Module,
    lifecycle: BackwardLifecycle,
    on_forward_start: Callable[[], None],
) -> list[RemovableHandle]:
    first_output_grad = lifecycle.hook(_nothing)

    def pre_forward(module: nn.Module, args: Any) -> None:
        on_forward_start()

    def post_forward(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or output is None:
            return
        tensors = grad_tensors_in(output)
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, first_output_grad, mode="any")

    return [
        root.register_forward_pre_hook(pre_forward, prepend=True),
        root.register_forward_hook(post_forward),
    ]
