"""torch's single-tensor all-gather and reduce-scatter, under the names the installed torch keeps.

torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` and
`reduce_scatter_tensor` to `reduce_scatter_single`; the old names still work there but
raise a `FutureWarning` on every call, in every process. The arguments are the same
(output first, then input; `op` for the reduce-scatter; `group`, `async_op`), and so is
what runs: the old names call the new ones, and each backend (gloo included) runs the same
operation. An older torch (zerodp supports 2.6 and later) has only the old names. This is
the one place that tells them apart; everything in zerodp that gathers into one tensor or
reduce-scatters one calls these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def _current(new: str, old: str) -> Callable[..., Any]:
    found = getattr(dist, new, None)
    return found if found is not None else getattr(dist, old)


# (output, input, group=None, async_op=False): every rank's `input`, concatenated in rank order.
all_gather_single: Callable[..., Any] = _current("all_gather_single", "all_gather_into_tensor")
# (output, input, op=SUM, group=None, async_op=False): rank r's part of the reduced `input`.
reduce_scatter_single: Callable[..., Any] = _current(
    "reduce_scatter_single", "reduce_scatter_tensor"
)

__all__ = ["all_gather_single", "reduce_scatter_single"]
