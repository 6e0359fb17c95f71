"""Lion with DeepSpeed's arguments: the config's `"type": "Lion"` and `zerodp.ops.lion`.

Per element, with g its gradient (Chen et al., "Symbolic Discovery of
Optimization Algorithms"):

    c  = beta1 * m + (1 - beta1) * g
    p <- p * (1 - lr * weight_decay) - lr * sign(c)
    m <- beta2 * m + (1 - beta2) * g

Defaults are DeepSpeed's (`betas=(0.9, 0.999)`, `weight_decay=0`). sign(0) is
0: an element whose c is exactly zero (a gradient and momentum both zero, as
for an embedding row no token used) only decays. DeepSpeed's kernels move such
an element by lr, in a direction that differs between its CUDA kernel (+lr) and
its CPU kernel (the sign bit of the zero); zerodp follows the algorithm. Every
element reads only itself, so zerodp steps Lion on flat shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerodp.optim.tensorwise import declare_elementwise


@declare_elementwise
class Lion(torch.optim.Optimizer):
    """Lion (see the module docstring); state key `exp_avg` holds the momentum."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if not lr > 0 or weight_decay < 0:
            raise ValueError(f"invalid lr {lr} or weight_decay {weight_decay}")
        if not all(0.0 <= beta <= 1.0 for beta in betas):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1]")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                state["step"] += 1
                exp_avg = state["exp_avg"]
                direction = exp_avg.mul(beta1).add_(param.grad, alpha=1 - beta1).sign_()
                if decay != 0:
                    param.mul_(1 - lr * decay)
                param.add_(direction, alpha=-lr)
                exp_avg.mul_(beta2).add_(param.grad, alpha=1 - beta2)
        return loss
