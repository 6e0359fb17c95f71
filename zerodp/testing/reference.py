"""Ideal data parallelism, computed plainly: the reference every parity test compares with.

A `ReferenceDP` holds a plain copy of the model on each rank. After every
backward, each parameter's gradient from that backward (its local
contribution) is averaged over ranks with an explicit all-reduce and added
to the gradient kept so far, so the reference follows PyTorch's rule
(gradients add up until `zero_grad()`) and is exact for every pattern,
including a second backward on a retained graph, where DDP is not.

For mixed precision the same recipe is written out by hand: the model copy
in bf16/fp16, gradients averaged in the model's dtype and kept in
`grad_dtype`, fp32 master weights (taken from the fp32 model before it is cast) stepped by
the optimizer after dividing out the loss scale, then copied back into the
model.
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
        *,
        dtype: torch.dtype = torch.float32,
        grad_dtype: torch.dtype | None = None,
        defer_reduction: bool = False,
    ) -> None:
        self.dtype = dtype
        self.mixed = dtype != torch.float32
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.params = [p for p in model.parameters() if p.requires_grad]
        # The tensors the optimizer steps: the parameters, or fp32 masters taken before
        # the model is cast (so they keep the initialisation's full precision).
        self.stepped: dict[int, torch.Tensor] = {
            id(p): nn.Parameter(p.detach().float().clone()) if self.mixed else p
            for p in self.params
        }
        self.model = model.to(dtype)
        self.grads: dict[int, torch.Tensor] = {
            id(p): torch.zeros(p.shape, dtype=grad_dtype or p.dtype, device=p.device)
            for p in self.params
        }
        # With defer_reduction, contributions are summed locally (in grad_dtype) and
        # averaged only by reduce_local(), as at an accumulation boundary.
        self.defer_reduction = defer_reduction
        self.local = {key: torch.zeros_like(grad) for key, grad in self.grads.items()}
        groups = param_groups_fn(model) if param_groups_fn is not None else self.params
        self.optimizer = optimizer_fn(self._to_stepped(groups)) if optimizer_fn else None

    def _to_stepped(self, groups: Any) -> Any:
        items = list(groups)
        if items and isinstance(items[0], dict):
            return [{**g, "params": [self.stepped[id(p)] for p in g["params"]]} for g in items]
        return [self.stepped[id(p)] for p in items]

    def run_backward(self, backward: Callable[[], None]) -> None:
        """Run one backward (a call that accumulates into .grad) and average its contribution."""
        for param in self.params:
            param.grad = None
        backward()
        self.collect()

    def collect(self) -> None:
        """Average the contributions now in `.grad` over ranks; add them to the kept gradients.

        A parameter that got a gradient on some ranks only (an expert no token was routed
        to here) contributes zeros on the others; one that got none anywhere is left alone.
        """
        self._zeros_where_others_have_grads()
        for param in self.params:
            if param.grad is None:
                continue
            if self.defer_reduction:
                self.local[id(param)] += param.grad.detach()
                param.grad = None
                continue
            local = param.grad.detach().clone()
            if self.world_size > 1:
                dist.all_reduce(local)
                local /= self.world_size
            self.grads[id(param)] += local
            param.grad = None

    def _zeros_where_others_have_grads(self) -> None:
        if self.world_size == 1 or not self.params:
            return
        device = self.params[0].device
        has_grad = torch.tensor(
            [p.grad is not None for p in self.params], dtype=torch.int32, device=device
        )
        dist.all_reduce(has_grad)
        for param, count in zip(self.params, has_grad.tolist(), strict=True):
            if count and param.grad is None:
                param.grad = torch.zeros_like(param)

    def reduce_local(self) -> None:
        """Average the locally summed contributions over ranks (the boundary's reduction)."""
        for key, local in self.local.items():
            if self.world_size > 1:
                dist.all_reduce(local)
                local.div_(self.world_size)
            self.grads[key] += local
            local.zero_()

    def grad(self, param: nn.Parameter) -> torch.Tensor:
        return self.grads[id(param)]

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The gradient a reduction now would give: the kept gradient plus, with
        defer_reduction, the local sums so far averaged over ranks by an explicit all-reduce
        (of a copy: the local sums stay local). A collective: every rank calls it for the
        same parameter. Between the boundaries of a deferred reduction this is what a
        data-parallel engine's full gradient is (zerodp's accessor reduces its local sum
        the same way)."""
        grad = self.grads[id(param)]
        if not self.defer_reduction:
            return grad
        local = self.local[id(param)].clone()
        if self.world_size > 1:
            dist.all_reduce(local)
            local.div_(self.world_size)
        return grad + local

    def zero_grad(self) -> None:
        for grad in self.grads.values():
            grad.zero_()

    def clip(self, max_norm: float) -> None:
        """Clip the kept gradients (fp32 models; mixed precision clips in `step`)."""
        grads = [self.grads[id(p)] for p in self.params]
        norm = torch.nn.utils.get_total_norm(grads)
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient)

    def step(self, loss_scale: float = 1.0, clip: float = 0.0) -> bool:
        """One optimizer step; returns False (and skips it) when a gradient overflowed."""
        if self.optimizer is None:
            raise RuntimeError("ReferenceDP was built without an optimizer")
        for param in self.params:
            stepped = self.stepped[id(param)]
            grad = self.grads[id(param)]
            stepped.grad = grad.float() / loss_scale if self.mixed else grad
        stepped_params = [self.stepped[id(p)] for p in self.params]
        norm = torch.nn.utils.get_total_norm([t.grad for t in stepped_params if t.grad is not None])
        if loss_scale != 1.0 and not torch.isfinite(norm):
            return False
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(stepped_params, clip, norm)
        self.optimizer.step()
        with torch.no_grad():
            for param in self.params:
                stepped = self.stepped[id(param)]
                stepped.grad = None
                if self.mixed:
                    param.copy_(stepped)
        return True

    def master(self, param: nn.Parameter) -> torch.Tensor:
        return self.stepped[id(param)].detach()
