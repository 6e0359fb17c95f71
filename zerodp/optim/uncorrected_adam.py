"""Adam without bias correction: DeepSpeed's `"bias_correction": false`.

torch's Adam and AdamW always divide the moments by (1 - beta^t); DeepSpeed's
fused and CPU Adam can leave that out (BERT's original recipe, and configs
such as DeepSpeedExamples' BingBertSquad keep it so). The update, per element,
with m and v the usual moving averages of the gradient and its square:

- `adam_w_mode=True` (decoupled weight decay, AdamW):
  p <- p - lr * (m / (sqrt(v) + eps) + weight_decay * p)
- `adam_w_mode=False` (L2, Adam): g <- g + weight_decay * p first, then
  p <- p - lr * m / (sqrt(v) + eps)

The weight decay reads p before the step, as DeepSpeed's kernels do. Every
element's update reads that element alone, so zerodp steps it on flat shards.
State keys are torch's (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints and
accessors treat it as Adam.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerodp.optim.tensorwise import declare_elementwise


@declare_elementwise
class UncorrectedAdam(torch.optim.Optimizer):
    """Adam(W) whose moments are not bias-corrected (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adam_w_mode: bool = True,
    ) -> None:
        if not lr > 0 or not eps > 0 or weight_decay < 0:
            raise ValueError(f"invalid lr {lr}, eps {eps} or weight_decay {weight_decay}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                uncorrected_adam_update(
                    param,
                    param.grad,
                    self.state[param],
                    beta1,
                    beta2,
                    lr,
                    eps,
                    decay,
                    adam_w_mode=group["adam_w_mode"],
                )
        return loss


def uncorrected_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    beta1: float,
    beta2: float,
    lr: float,
    eps: float,
    decay: float,
    *,
    adam_w_mode: bool,
) -> None:
    """One element-wise Adam(W) update of `param` without bias correction (module docstring);
    `state` holds torch's Adam keys and is filled on first use."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param)
        state["exp_avg_sq"] = torch.zeros_like(param)
    state["step"] += 1
    if decay != 0 and not adam_w_mode:
        grad = grad.add(param, alpha=decay)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    update = exp_avg / (exp_avg_sq.sqrt() + eps)
    if decay != 0 and adam_w_mode:
        update.add_(param, alpha=decay)
    param.add_(update, alpha=-lr)
