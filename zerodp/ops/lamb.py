"""DeepSpeed's `FusedLamb` with its constructor arguments: zerodp's LAMB, which computes
DeepSpeed's kernel term for term (`zerodp.optim.lamb`).

Its trust ratio reads whole tensors, so zerodp steps it on whole tensors, each
at the rank that owns it. `max_grad_norm` (clipping inside the kernel, by a
norm the caller passes) and AMSGrad are refused: set `gradient_clipping` in the
config instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from zerodp.errors import UsageError
from zerodp.optim.lamb import Lamb

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    """DeepSpeed's `FusedLamb(params, lr, bias_correction, betas, eps, eps_inside_sqrt,
    weight_decay, max_grad_norm, max_coeff, min_coeff, amsgrad)`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise UsageError("FusedLamb has no AMSGrad variant (as in DeepSpeed); drop amsgrad")
        if max_grad_norm > 0:
            raise UsageError(
                f"FusedLamb(max_grad_norm={max_grad_norm}): zerodp clips the global gradient "
                f'norm itself; set "gradient_clipping": {max_grad_norm} in the config instead'
            )
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )

    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: float = 1.0,
        grad_norms: Any = None,
    ) -> float | None:
        """A LAMB step on the parameters' `.grad`; DeepSpeed's other arguments (explicit
        gradients, output copies, a scale, norms) belong to its fp16 wrapper and are refused."""
        if grads is not None or output_params is not None or scale != 1.0 or grad_norms:
            raise UsageError(
                "FusedLamb.step() takes the gradients from .grad: zerodp's engine handles "
                "loss scaling and mixed precision; call step() or step(closure)"
            )
        return super().step(closure)
