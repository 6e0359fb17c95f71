"""Tiled compute along the sequence: a token-wise module, or the logits and their loss, a tile
of tokens at a time, so the largest activation of the whole sequence never exists at once.

[Note: tiled compute]
A module that acts on each token alone (an MLP: (batch, tokens, hidden) in, the same
shape out) gives the same output when it runs on the tokens a tile at a time, and the
same gradient when each tile's backward is summed. Untiled, its backward keeps its
intermediate activations for every token (an MLP's is intermediate_size wide, several
times the hidden size; the output layer's logits are vocab_size wide). Tiled:

- forward, without autograd: each tile's output, concatenated (the logits and loss:
  each tile's logits, its summed cross-entropy, added up; then divided by the
  micro-batch's target count, as transformers' causal LM loss does). Only the
  input is kept for backward.
- backward: each tile's forward again, with autograd, and its backward at once:
  the input's gradient for the tile, and the parameters' gradients summed over the
  tiles. One tile's intermediates exist at a time.

The parameters are inputs of the autograd Function, and their gradients leave it
once, summed: each parameter's gradient is accumulated once per backward, as an
untiled module's is, so the reduction's hooks fire once.

Stage 3 (hang-free whatever each rank's tile count): the tiles run inside one call
of the module (the engine's hooks on the module gather its parameters once, before
its forward and before its backward), and the hooks of the modules inside it are
taken out while the tiles run (`quiet`), so that no per-module hook, and so no
collective, runs once per tile. A parameter read inside a tile is gathered on use,
once, for the module that runs it (stage 3's rule for a parent reading a child's
weight), and stays gathered until the module is done; every later tile finds it
gathered. The collectives of a rank are therefore the same whatever its number of
tiles: a rank whose sequence is shorter cannot hang the others.

Exact: the same operations on the same numbers, in tiles; only the order of the
additions that sum the tiles' parameter gradients (and losses) differs (fp32
round-off; tested against the untiled model at 1e-5).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# A context under which the engine's per-module hooks inside the tiled module do nothing.
Quiet = Callable[[], contextlib.AbstractContextManager[Any]]


def tiles(length: int, tile: int) -> Iterator[slice]:
    """The token ranges of `length` tokens, `tile` at a time (the last one may be shorter)."""
    for start in range(0, length, tile):
        yield slice(start, min(start + tile, length))


def _token_dim(x: torch.Tensor) -> int:
    return x.dim() - 2  # (..., tokens, features)


def _grads_of(
    output: torch.Tensor,
    inputs: tuple[torch.Tensor, ...],
    grad: torch.Tensor,
) -> tuple[torch.Tensor | None, ...]:
    return torch.autograd.grad(output, inputs, grad, allow_unused=True)


def _add(total: list[torch.Tensor | None], parts: tuple[torch.Tensor | None, ...]) -> None:
    for index, part in enumerate(parts):
        if part is None:
            continue
        current = total[index]
        total[index] = part if current is None else current + part


def _filled(totals: list[torch.Tensor | None], params: tuple[torch.Tensor, ...]) -> list[Any]:
    """The summed gradients, zeros for a parameter no tile used (as for an untiled module
    whose forward reads a parameter that gets no gradient, every rank returns a tensor)."""
    return [
        t if t is not None else torch.zeros_like(p) for t, p in zip(totals, params, strict=True)
    ]


class _TiledTokenwise(torch.autograd.Function):
    """`run(x)` a tile of tokens at a time ([Note: tiled compute]); `params`: run's parameters."""

    @staticmethod
    def forward(
        ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], quiet: Quiet, tile: int,
        x: torch.Tensor, *params: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        ctx.run, ctx.quiet, ctx.tile, ctx.params = run, quiet, tile, params
        ctx.save_for_backward(x)
        dim = _token_dim(x)
        with quiet():
            parts = [run(x[(slice(None),) * dim + (s,)]) for s in tiles(x.shape[dim], tile)]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        dim = _token_dim(x)
        params: tuple[torch.Tensor, ...] = ctx.params
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        totals: list[torch.Tensor | None] = [None] * len(params)
        with torch.enable_grad(), ctx.quiet():
            for s in tiles(x.shape[dim], ctx.tile):
                index = (slice(None),) * dim + (s,)
                piece = x[index].detach().requires_grad_(grad_x is not None)
                out = ctx.run(piece)
                wanted = ((piece,) if grad_x is not None else ()) + params
                got = _grads_of(out, wanted, grad[index])
                if grad_x is not None:
                    grad_x[index] = got[0] if got[0] is not None else 0
                    got = got[1:]
                _add(totals, got)
        return (None, None, None, grad_x, *_filled(totals, params))


def tiled_tokenwise(
    run: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    params: list[torch.Tensor],
    tile: int,
    quiet: Quiet = contextlib.nullcontext,
) -> torch.Tensor:
    """`run(x)` for a token-wise `run`, computed `tile` tokens at a time ([Note: tiled compute]).

    Always through the tiles, even when one tile holds every token: at stage 3 the path a
    rank takes must not depend on its sequence length (see the Note)."""
    if torch.is_grad_enabled():
        return _TiledTokenwise.apply(run, quiet, tile, x, *params)
    dim = _token_dim(x)
    with quiet():
        parts = [run(x[(slice(None),) * dim + (s,)]) for s in tiles(x.shape[dim], tile)]
    return torch.cat(parts, dim=dim)


def _tile_loss_sum(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = head(hidden).float()  # transformers' causal LM loss upcasts the logits too
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


class _TiledLogitsLoss(torch.autograd.Function):
    """sum over tiles of cross_entropy(head(hidden tile), targets tile, sum) / count."""

    @staticmethod
    def forward(
        ctx: Any, head: Callable[[torch.Tensor], torch.Tensor], quiet: Quiet, tile: int,
        hidden: torch.Tensor, targets: torch.Tensor, count: torch.Tensor, *params: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        ctx.head, ctx.quiet, ctx.tile, ctx.params = head, quiet, tile, params
        ctx.save_for_backward(hidden, targets, count)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with quiet():
            for s in tiles(hidden.shape[1], tile):
                total = total + _tile_loss_sum(head, hidden[:, s], targets[:, s])
        return total / count.to(total.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        hidden, targets, count = ctx.saved_tensors
        params: tuple[torch.Tensor, ...] = ctx.params
        wants_hidden = bool(ctx.needs_input_grad[3])
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        totals: list[torch.Tensor | None] = [None] * len(params)
        scale = grad / count.to(grad.device)
        with torch.enable_grad(), ctx.quiet():
            for s in tiles(hidden.shape[1], ctx.tile):
                piece = hidden[:, s].detach().requires_grad_(wants_hidden)
                part = _tile_loss_sum(ctx.head, piece, targets[:, s])
                wanted = ((piece,) if wants_hidden else ()) + params
                got = _grads_of(part, wanted, scale)
                if grad_hidden is not None:
                    grad_hidden[:, s] = got[0] if got[0] is not None else 0
                    got = got[1:]
                _add(totals, got)
        return (None, None, None, grad_hidden, None, None, *_filled(totals, params))


def tiled_logits_loss(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    count: torch.Tensor,
    params: list[torch.Tensor],
    tile: int,
    quiet: Quiet = contextlib.nullcontext,
) -> torch.Tensor:
    """The causal LM loss of `hidden` (batch, tokens, hidden) against shifted `targets`
    (batch, tokens; IGNORE_INDEX: no target) over `count` targets, computed `tile` tokens at
    a time: no more than one tile's logits ever exist ([Note: tiled compute])."""
    return _TiledLogitsLoss.apply(head, quiet, tile, hidden, targets, count, *params)
