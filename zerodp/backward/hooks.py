"""The hooks through which autograd tells zerodp that a backward is running (every stage).

- On the root module's forward outputs: the first of them to receive a
  gradient in a graph task starts that task's lifecycle, including tasks that
  accumulate no `.grad` (`torch.autograd.grad`).
- On each trainable parameter, before its gradient is accumulated: makes sure
  the task's prologue ran before autograd touches `param.grad`.
- On each trainable parameter, after its gradient is accumulated: hands the
  gradient to the reducer. See [Note: gradient reduction].
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


def install_parameter_hooks(
    params: list[nn.Parameter], lifecycle: BackwardLifecycle, reducer: GradientReducer
) -> list[RemovableHandle]:
    handles = []
    for param in params:

        def before_accumulate(grad: torch.Tensor) -> None:
            lifecycle.observe()

        def after_accumulate(param: torch.Tensor) -> None:
            lifecycle.observe()
            reducer.contribute(param)  # type: ignore[arg-type]

        handles.append(param.register_hook(before_accumulate))
        handles.append(param.register_post_accumulate_grad_hook(after_accumulate))
    return handles


def install_root_hooks(
    root: nn.Module,
    lifecycle: BackwardLifecycle,
    on_forward_start: Callable[[], None],
) -> list[RemovableHandle]:
    def pre_forward(module: nn.Module, args: Any) -> None:
        on_forward_start()

    def post_forward(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or output is None:
            return
        tensors = grad_tensors_in(output)
        if tensors:

            def first_output_grad(grad: torch.Tensor) -> None:
                lifecycle.observe()

            torch.autograd.graph.register_multi_grad_hook(tensors, first_output_grad, mode="any")

    return [
        root.register_forward_pre_hook(pre_forward, prepend=True),
        root.register_forward_hook(post_forward),
    ]
