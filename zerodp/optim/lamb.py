"""LAMB as DeepSpeed's FusedLamb computes it: the config's `"type": "Lamb"` and
`zerodp.ops.lamb.FusedLamb`.

Per tensor, with g its gradient and t its step count:

    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    u  = m / (sqrt(v) + eps) + weight_decay * p      (sqrt(v + eps) with eps_inside_sqrt)
    r  = clamp(||p|| / ||u||, min_coeff, max_coeff)  (1 when either norm is 0)
    p <- p - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * r * u

The bias corrections scale the step, not the moments (so eps is added to the
uncorrected sqrt(v)), and the trust ratio r compares the weight with the update
before the learning rate: DeepSpeed's kernel, term for term. Without
`bias_correction` the step is lr * r * u. The trust ratio reads whole tensors,
so zerodp steps LAMB on whole tensors (`zerodp.optim.tensorwise`), each at the
rank that owns it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lamb(torch.optim.Optimizer):
    """LAMB with DeepSpeed FusedLamb's arguments and arithmetic (see the module docstring).

    `lamb_coeffs` holds the trust ratio of each tensor the last step updated (on
    this rank), as tensors; `get_lamb_coeffs()` reads them as floats.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if not lr > 0 or not eps > 0 or weight_decay < 0:
            raise ValueError(f"invalid lr {lr}, eps {eps} or weight_decay {weight_decay}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"invalid min_coeff {min_coeff} / max_coeff {max_coeff}")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.lamb_coeffs.append(self._update(param, group))
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        grad = param.grad
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["eps_inside_sqrt"]:
            denom = (exp_avg_sq + group["eps"]).sqrt_()
        else:
            denom = exp_avg_sq.sqrt().add_(group["eps"])
        update = exp_avg / denom
        if group["weight_decay"] != 0:
            update.add_(param, alpha=group["weight_decay"])
        weight_norm, update_norm = param.norm(), update.norm()
        ratio = (weight_norm / update_norm).clamp(group["min_coeff"], group["max_coeff"])
        ratio = torch.where((weight_norm != 0) & (update_norm != 0), ratio, torch.ones_like(ratio))
        step_size = group["lr"]
        if group["bias_correction"]:
            t = int(state["step"].item())
            step_size *= math.sqrt(1 - beta2**t) / (1 - beta1**t)
        param.sub_(update.mul_(ratio * step_size))
        return ratio

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step (this rank's tensors), as DeepSpeed names them."""
        return [float(coeff.item()) for coeff in self.lamb_coeffs]
