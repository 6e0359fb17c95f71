"""The two exchanges of expert parallelism, on zerodp's own `Comm`: counts, then rows.

`exchange_counts` tells every EP rank how many rows it will receive from each
rank for each of its experts (one small all-to-all of N integers per rank).
`Route` holds the resulting row counts per rank, on the host, in both
directions. `exchange_rows` sends rows along a route with autograd: its
backward sends the gradient back along the reversed route, through the same
function, so the backward of the dispatch is the combine's forward and the
backward of the combine is the dispatch's forward, and a backward run with
`create_graph=True` can itself be differentiated. Both count their bytes in
the `Comm`'s stats (an all-to-all counts what this rank sends to other ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerodp.comm import Comm
from zerodp.parallel.expert_slices import held_experts


@dataclass(frozen=True)
class Route:
    """Rows this rank sends to each rank (`send`) and receives from each rank (`receive`)."""

    send: tuple[int, ...]
    receive: tuple[int, ...]

    def reversed(self) -> Route:
        """The way back: what was received is sent, and the reverse."""
        return Route(self.receive, self.send)


def exchange_counts(per_expert: torch.Tensor, comm: Comm) -> torch.Tensor:
    """From this rank's count of assignments per expert ([N], experts of rank r at
    [r * n, (r + 1) * n)), every rank's count for this rank's n experts: [E, n], by
    source rank (an all-to-all outside autograd)."""
    size = comm.world_size
    local = len(held_experts(per_expert.numel(), size, comm.rank))
    send = per_expert.detach().to(torch.int64).contiguous()
    received = torch.empty_like(send)
    comm.all_to_all(received, send, [local] * size, [local] * size)
    return received.view(size, local)


def exchange_rows(rows: torch.Tensor, comm: Comm, route: Route) -> torch.Tensor:
    """Send `rows` (consecutive runs of `route.send[r]` rows for each rank r) and receive
    `route.receive[r]` rows from each rank r, in rank order; differentiable (see the
    module docstring)."""
    out: torch.Tensor = _ExchangeRows.apply(rows, comm, route)
    return out


def _exchange(rows: torch.Tensor, comm: Comm, route: Route) -> torch.Tensor:
    if rows.shape[0] != sum(route.send):
        raise ValueError(
            f"internal error: {rows.shape[0]} rows to send, the route sends {sum(route.send)}"
        )
    rows = rows.contiguous()
    width = int(torch.Size(rows.shape[1:]).numel())
    out = rows.new_empty((sum(route.receive), *rows.shape[1:]))
    comm.all_to_all(
        out.view(-1),
        rows.view(-1),
        [n * width for n in route.receive],
        [n * width for n in route.send],
    )
    return out


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, comm: Comm, route: Route) -> torch.Tensor:
        ctx.comm, ctx.route = comm, route
        return _exchange(rows, comm, route)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _ExchangeRows.apply(grad, ctx.comm, ctx.route.reversed()), None, None
