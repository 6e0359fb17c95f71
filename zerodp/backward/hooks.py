"""The hooks through which autograd tells zerodp that a backward is running (every stage).

- On the root module's forward outputs: the first of them to receive a
  gradient in a graph task starts that task's lifecycle, including tasks that
  accumulate no `.grad` (`torch.autograd.grad`).
- On each trainable parameter, after its gradient is accumulated: hands the
  gradient to the reducer. See [Note: gradient reduction]. When this hook is
  the first of a new task, its observation runs the prologue with the freshly
  accumulated gradient kept aside (`BackwardLifecycle.accumulated_grad_hook`).
- At stage 0 only, on each trainable parameter, before its gradient is
  accumulated: makes sure the task's prologue ran before autograd touches
  `param.grad`. Stage 0 shows the kept gradients as `param.grad` between
  tasks; autograd would add into those views in place, so the prologue must
  take them back first. At stages 1-3 `.grad` is None between tasks and this
  second hook per parameter is not installed.

Every hook is registered through `BackwardLifecycle.hook` or
`BackwardLifecycle.accumulated_grad_hook` (see [Note: backward lifecycle]).
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
from zerodp.group_state import GroupState


def _nothing(*args: Any) -> None:
    """A hook whose only job is the observation `BackwardLifecycle.hook` adds."""


def install_parameter_hooks(
    states: list[GroupState], lifecycle: BackwardLifecycle, reducer: GradientReducer
) -> list[RemovableHandle]:
    handles = []
    shows_grads = reducer.param_grads is not None  # stage 0: `.grad` views between tasks
    before_accumulate = lifecycle.hook(_nothing)
    for state in states:
        for position, param in enumerate(state.params):

            def after_accumulate(
                param: torch.Tensor, state: GroupState = state, position: int = position
            ) -> None:
                reducer.contribute(state, position, param)  # type: ignore[arg-type]

            hook: Callable[[torch.Tensor], None]
            if shows_grads:
                handles.append(param.register_hook(before_accumulate))
                hook = lifecycle.hook(after_accumulate)
            else:
                hook = lifecycle.accumulated_grad_hook(after_accumulate)
            handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles


class RootHooks:
    """The root module's forward hooks: each forward starts with the engine's checks, and its
    outputs get the hook that tells the lifecycle a backward through them has started.

    Under `torch.compile` of the root's own call (`model.compile()`), the hooks are traced
    with the forward; what they do cannot be traced (it inspects the running autograd task
    and registers hooks on tensors the graph has not produced yet), so a traced hook only
    records that its work is deferred (dynamo replays the attribute write after the
    graph), and `after_call`, which the engine runs on the forward's result outside the
    graph, does it there. A forward called without the engine under `model.compile()`
    keeps its backward's lifecycle all the same: the parameter hooks start it.
    """

    def __init__(
        self,
        root: nn.Module,
        lifecycle: BackwardLifecycle,
        on_forward_start: Callable[[tuple[Any, ...], dict[str, Any]], None],
    ) -> None:
        self._first_output_grad = lifecycle.hook(_nothing)
        self._on_forward_start = on_forward_start
        self.deferred = False  # a traced post-forward left its work to `after_call`
        self.handles = [
            root.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
            root.register_forward_hook(self._post_forward),
        ]

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return
        self._on_forward_start(args, kwargs)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            self.deferred = True
            return
        self._mark_outputs(output)

    def _mark_outputs(self, output: Any) -> None:
        if not torch.is_grad_enabled() or output is None:
            return
        tensors = grad_tensors_in(output)
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, self._first_output_grad, mode="any"
            )

    def after_call(self, output: Any) -> Any:
        """The engine's forward result: marked here if a traced post-forward deferred it."""
        if self.deferred:
            self.deferred = False
            self._mark_outputs(output)
        return output
