"""What the optimizer steps for one group: the owned range in place, or a separate copy of it."""

from __future__ import annotations

import torch
from torch import nn

from zerodp.partition import FlatGroup


class OptimizerParam:
    """The torch optimizer's parameter for one trainable group, and its optional copy.

    Without a copy (fp32 training) `param` aliases the model's owned range, so
    the optimizer updates the parameters in place. With one (the fp32 master
    under mixed precision; later a host copy for offload) `param` aliases the
    copy, and `copy_to_model()` writes the stepped values back into the
    model's owned range.
    """

    def __init__(self, flat: FlatGroup, copy: torch.Tensor | None = None) -> None:
        if copy is not None and copy.numel() != flat.owned.numel():
            raise ValueError(
                f"optimizer copy of {flat} has {copy.numel()} elements, the owned range "
                f"{flat.owned.numel()}"
            )
        self.flat = flat
        self.copy = copy
        self.param = nn.Parameter(copy if copy is not None else flat.owned, requires_grad=True)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """After a step: the model's owned range takes the stepped values."""
        if self.copy is not None:
            self.flat.owned.copy_(self.copy)

    @torch.no_grad()
    def refresh_from_model(self) -> None:
        """After the model was changed outside the optimizer: the copy takes its values."""
        if self.copy is not None:
            self.copy.copy_(self.flat.owned)
