"""DeepSpeed's Adam classes with their constructor arguments, on torch's Adam.

`FusedAdam` (DeepSpeed's CUDA kernel) and `DeepSpeedCPUAdam` (its AVX kernel)
take DeepSpeed's arguments and compute what those arguments mean with torch's
Adam: `adam_w_mode` / `adamw_mode` choose decoupled weight decay (AdamW) or L2,
the defaults are DeepSpeed's (`weight_decay` 0), and `bias_correction=False`
is zerodp's `UncorrectedAdam` update, per param group. With bias correction
the step is torch's Adam (its fused kernel where torch has one for the
parameters' device, as zerodp's config optimizer), so `FusedAdam(...)` and the
config block `{"type": "Adam", ...}` give the same numbers. Both are
elementwise: zerodp steps them on flat shards.

AMSGrad is refused, as DeepSpeed refuses it; so is `fp32_optimizer_states=False`
(zerodp keeps fp32 moments beside its fp32 master weights).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerodp.errors import UsageError
from zerodp.optim.factory import steps_fused
from zerodp.optim.tensorwise import declare_elementwise
from zerodp.optim.uncorrected_adam import uncorrected_adam_update

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class _DeepSpeedAdam(torch.optim.Adam):
    """torch's Adam with DeepSpeed's `bias_correction` per param group."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float,
        bias_correction: bool,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        amsgrad: bool,
        decoupled: bool,
    ) -> None:
        name = type(self).__name__
        if amsgrad:
            raise UsageError(f"{name} has no AMSGrad variant (as in DeepSpeed); drop amsgrad=True")
        params = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in params]
        self._bias_correction = bias_correction  # read by add_param_group, which torch calls
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            fused=True if _fused_kernel_fits(params) else None,
            decoupled_weight_decay=decoupled,
        )
        self.defaults["bias_correction"] = bias_correction

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("amsgrad"):
            raise UsageError(f"{type(self).__name__} has no AMSGrad variant; drop amsgrad")
        param_group.setdefault("bias_correction", self._bias_correction)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        every = self.param_groups
        corrected = [group for group in every if group["bias_correction"]]
        try:
            self.param_groups = corrected  # torch's step for the groups it can step
            if corrected:
                super().step()
        finally:
            self.param_groups = every
        for group in every:
            if not group["bias_correction"]:
                self._step_uncorrected(group)
        return loss

    def _step_uncorrected(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        for param in group["params"]:
            if param.grad is not None:
                uncorrected_adam_update(
                    param,
                    param.grad,
                    self.state[param],
                    beta1,
                    beta2,
                    group["lr"],
                    group["eps"],
                    group["weight_decay"],
                    adam_w_mode=group["decoupled_weight_decay"],
                )


def _fused_kernel_fits(params: list[Any]) -> bool:
    """Whether torch's fused Adam kernel takes every parameter (floating, on its devices)."""
    tensors = [
        tensor
        for item in params
        for tensor in (item["params"] if isinstance(item, dict) else [item])
        if isinstance(tensor, torch.Tensor)
    ]
    return bool(tensors) and all(t.is_floating_point() and steps_fused(t.device) for t in tensors)


@declare_elementwise
class FusedAdam(_DeepSpeedAdam):
    """DeepSpeed's `FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode,
    weight_decay, amsgrad, set_grad_none)`; see the module docstring."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled=adam_w_mode,
        )
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


@declare_elementwise
class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """DeepSpeed's `DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps,
    weight_decay, amsgrad, adamw_mode, fp32_optimizer_states)`; see the module docstring.

    Where the step runs is zerodp's choice (`zero_optimization.offload_optimizer`), not
    the class's: on a CUDA model without offload it steps on the GPU.
    """

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if not fp32_optimizer_states:
            raise UsageError(
                "DeepSpeedCPUAdam(fp32_optimizer_states=False): zerodp keeps Adam's moments in "
                "fp32 beside its fp32 master weights; drop the argument"
            )
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            decoupled=adamw_mode,
        )
