"""Ideal data parallelism, computed plainly: the reference every parity test compares with.

A `ReferenceDP` holds a plain copy of the model on each rank. After every
backward, each parameter's gradient from that backward (its local
contribution) is averaged over ranks with an explicit all-reduce and added
to the gradient kept so far, so the reference follows PyTorch's rule
(gradients add up until `zero_grad()`) and is exact for every pattern,
including a second backward on a retained graph, where DDP is not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class ReferenceDP:
    def __init__(
        self,
        model: nn.Module,
        optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None = None,
        param_groups_fn: Callable[[nn.Module], Any] | None = None,
    ) -> None:
        self.model = model
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads: dict[int, torch.Tensor] = {
            id(p): torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self.params
        }
        groups = param_groups_fn(model) if param_groups_fn is not None else self.params
        self.optimizer = optimizer_fn(groups) if optimizer_fn is not None else None

    def run_backward(self, backward: Callable[[], None]) -> None:
        """Run one backward (a call that accumulates into .grad) and average its contribution."""
        for param in self.params:
            param.grad = None
        backward()
        self.collect()

    def collect(self) -> None:
        """Average the contributions now in `.grad` over ranks; add them to the kept gradients."""
        for param in self.params:
            if param.grad is None:
                continue
            local = param.grad.detach().clone()
            if self.world_size > 1:
                dist.all_reduce(local)
                local /= self.world_size
            self.grads[id(param)] += local
            param.grad = None

    def grad(self, param: nn.Parameter) -> torch.Tensor:
        return self.grads[id(param)]

    def zero_grad(self) -> None:
        for grad in self.grads.values():
            grad.zero_()

    def clip(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(list(self._install_grads()), max_norm)

    def step(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("ReferenceDP was built without an optimizer")
        list(self._install_grads())
        self.optimizer.step()
        for param in self.params:
            param.grad = None

    def _install_grads(self) -> Any:
        for param in self.params:
            param.grad = self.grads[id(param)]
            yield param
