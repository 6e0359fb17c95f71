"""Every rank takes world rank 0's whole model before a split (tensor or expert parallelism).

A split keeps each rank's part of every split tensor: the parts are those of one model
only if every rank held the same model before (rule 4 of [Note: parallel dimensions] in
`zerodp.parallel.dims`). After the split, each flat group is taken from the first rank of
the ranks holding the same values (`zerodp.engine.model_groups`), which a slice's own
values already are.
"""

from __future__ import annotations

import torch
from torch import nn

from zerodp.comm import Comm, broadcast_tensors
from zerodp.torch_internals import replace_buffers


@torch.no_grad()
def take_whole_model_from_first_rank(module: nn.Module, world: Comm, device: torch.device) -> None:
    """Every rank gets world rank 0's parameters and buffers, on `device` (a collective)."""
    for param in module.parameters():
        param.data = param.data.to(device)
    replace_buffers(module, lambda buffer: buffer.to(device))
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    broadcast_tensors(world, tensors)
