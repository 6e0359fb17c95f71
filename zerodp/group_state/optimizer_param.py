"""What the optimizer steps for one group: the owned range in place, or a separate copy of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerodp.partition import FlatGroup


@dataclass
class HostBuffers:
    """The host-side buffers of an offloaded group, allocated once and reused every step.

    `grad`: the gradient in the optimizer's dtype, which the optimizer reads.
    `grad_transfer`: the gradient as it crosses from the device, in the kept
        gradient's dtype (so a bf16 gradient moves half the bytes), then upcast
        into `grad`; None when the two dtypes agree.
    `model_staging`: the stepped values cast to the model's dtype on the host
        before they cross to the device; None for an fp32 model.
    """

    grad: torch.Tensor
    grad_transfer: torch.Tensor | None = None
    model_staging: torch.Tensor | None = None


class OptimizerParam:
    """The torch optimizer's parameter for one trainable group, and its optional copy.

    Without a copy (fp32 training) `param` aliases the model's owned range, so
    the optimizer updates the parameters in place. With one, `param` aliases
    the copy and `copy_to_model()` writes the stepped values back into the
    model's owned range. The copy is the fp32 master under mixed precision; with
    optimizer offload it lives on the host (or in a file), and so does the
    optimizer state the torch optimizer keeps for `param` (`host` is set).
    """

    def __init__(
        self,
        flat: FlatGroup,
        copy: torch.Tensor | None = None,
        *,
        host: HostBuffers | None = None,
    ) -> None:
        if copy is not None and copy.numel() != flat.owned.numel():
            raise ValueError(
                f"optimizer copy of {flat} has {copy.numel()} elements, the owned range "
                f"{flat.owned.numel()}"
            )
        if host is not None and copy is None:
            raise ValueError(f"{flat}: an offloaded group needs its optimizer copy")
        self.flat = flat
        self.copy = copy
        self.host = host
        self.param = nn.Parameter(copy if copy is not None else flat.owned, requires_grad=True)

    @property
    def offloaded(self) -> bool:
        """Whether the optimizer steps this group on the host (optimizer offload)."""
        return self.host is not None

    # -- the gradient, on its way to the optimizer -------------------------------------

    def start_grad_transfer(self, grad: torch.Tensor) -> None:
        """Offloaded: start copying the averaged gradient to the host (without waiting)."""
        if self.host is None:
            return
        target = self.host.grad_transfer if self.host.grad_transfer is not None else self.host.grad
        target.copy_(grad, non_blocking=True)

    def grad_for_optimizer(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient the optimizer reads (after `start_grad_transfer` and a device sync)."""
        if self.host is None:
            param = self.param
            return (
                grad
                if grad.dtype == param.dtype and grad.device == param.device
                else (grad.to(param))
            )
        if self.host.grad_transfer is not None:
            self.host.grad.copy_(self.host.grad_transfer)  # upcast on the host
        return self.host.grad

    # -- the stepped values, on their way to the model -----------------------------------

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """After a step: the model's owned range takes the stepped values."""
        if self.copy is None:
            return
        staging = self.host.model_staging if self.host is not None else None
        if staging is not None:
            staging.copy_(self.copy)  # cast on the host: half the bytes cross to the device
            self.flat.owned.copy_(staging, non_blocking=True)
        else:
            self.flat.owned.copy_(self.copy, non_blocking=self.host is not None)

    @torch.no_grad()
    def refresh_from_model(self) -> None:
        """After the model was changed outside the optimizer: the copy takes its values."""
        if self.copy is not None:
            self.copy.copy_(self.flat.owned)
