"""DeepSpeed's `DeepSpeedCPUAdagrad` with its constructor arguments: torch's Adagrad.

DeepSpeed's kernel is torch's Adagrad without learning-rate decay and with a
zero initial accumulator (its defaults: lr 1e-2, eps 1e-10, weight_decay 0,
weight decay as L2), which is what this class builds. Elementwise: zerodp steps
it on flat shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerodp.errors import UsageError
from zerodp.optim.tensorwise import declare_elementwise

__all__ = ["DeepSpeedCPUAdagrad"]


@declare_elementwise
class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's `DeepSpeedCPUAdagrad(model_params, lr, eps, weight_decay, amsgrad,
    fp32_optimizer_states)`."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise UsageError("Adagrad has no AMSGrad variant; drop amsgrad=True")
        if not fp32_optimizer_states:
            raise UsageError(
                "DeepSpeedCPUAdagrad(fp32_optimizer_states=False): zerodp keeps the "
                "accumulator in fp32 beside its fp32 master weights; drop the argument"
            )
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
