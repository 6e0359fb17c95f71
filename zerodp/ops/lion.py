"""DeepSpeed's `FusedLion` and `DeepSpeedCPULion` with their constructor arguments:
zerodp's Lion (`zerodp.optim.lion`), elementwise, stepped on flat shards."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zerodp.errors import UsageError
from zerodp.optim.lion import Lion
from zerodp.optim.tensorwise import declare_elementwise

__all__ = ["DeepSpeedCPULion", "FusedLion"]


@declare_elementwise
class FusedLion(Lion):
    """DeepSpeed's `FusedLion(params, lr, betas, weight_decay, set_grad_none)`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


@declare_elementwise
class DeepSpeedCPULion(Lion):
    """DeepSpeed's `DeepSpeedCPULion(model_params, lr, betas, weight_decay,
    fp32_optimizer_states)`; where it steps is zerodp's offload setting."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if not fp32_optimizer_states:
            raise UsageError(
                "DeepSpeedCPULion(fp32_optimizer_states=False): zerodp keeps the momentum in "
                "fp32 beside its fp32 master weights; drop the argument"
            )
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
