"""The forward of a split experts module: tokens to their experts' ranks and back.

[Note: expert-parallel dispatch]
Each of the E ranks of an EP group reads its own tokens and holds n = N / E of
the N experts of every MoE layer (rank e: experts [e * n, (e + 1) * n)). The
router runs on each rank, unchanged, on that rank's tokens; its choice
(`top_k_index`, `top_k_weights` [T, K]) reaches the experts module, whose
forward is replaced by this one:

1. The T x K slots are assignments (token t to expert k). A slot whose index
   lies outside [0, N) (a model's own sentinel for a masked slot) is no
   assignment: sent nowhere, it contributes nothing, and its weight gets a zero
   gradient, as in the model's own forward.
2. The assignments, ordered by expert, are counted per expert, and one
   all-to-all of N integers per rank tells each rank how many rows it receives
   from each rank for each of its experts (`exchange_counts`). Then one
   all-to-all sends each assignment's token row to the rank holding its expert
   (the dispatch); the receiver knows each row's local expert from the counts.
3. The receiving rank runs the model's own experts forward (the original class's
   `forward`) on the rows it received, each with its local expert, K = 1 and
   weight 1: the model's own expert math (activation, gpt-oss's clamped GLU and
   biases, any `experts_implementation`) is used as it is, only on fewer
   experts (the module's expert count is n while split). Multiplying by a
   weight of 1 is exact, so each row is that expert's output for that token.
4. A second all-to-all sends each result back to the rank its token came from
   (the combine), and that rank applies the routing weights and sums the K
   results of each token, as the model's own forward does after its expert
   loop.

Why it is exact. The output of a token is sum_k w[t, k] * f_{i[t, k]}(x[t])
on every rank as in one process: each expert's f is the same function of the
same row, computed where the expert lives, and the weighting and the sum are
the model's own operations on the token's own rank. So the gradients are the
one-process gradients too, by the chain rule through two all-to-alls whose
backward is the reverse exchange (`exchange_rows`):
- the router's gradient is computed where the router ran, from
  dL/dw[t, k] = <dL/dout[t], f(x[t])>, with no term lost or counted twice (an
  engine that applies the weights on the expert's rank must send the weight's
  gradient back, which is where transformers #48687 went wrong);
- an expert's gradient on its rank sums the contributions of every token that
  reached it from every rank of the group: it is already the group's sum, as
  an ordinary gradient is after its all-reduce over these ranks (what it is
  divided by is the engine's rule);
- the input's gradient returns along the reverse routes and is summed into
  each token's row on its own rank.
The K results of a token are summed in slot order, as the model's
grouped/batched implementations do (its eager loop sums in expert order), so
fp32 results agree with one process to round-off, not always bitwise.

An expert that gets no token on any rank still has a gradient, exactly zero:
the model's forward reads each fused tensor as a whole (grouped_mm) or by
indexing it (eager, batched_mm), whose gradient is a whole tensor with zeros
for the experts not read. When this rank receives no row at all, the model's
forward would not read the tensors, so each tensor is touched by an empty
slice that adds nothing to the output and gives it a zero gradient: every
expert parameter has a `.grad` after every backward, on every rank, and an
engine's hooks on them fire alike everywhere.

Every rank of an EP group must run every experts forward, and every backward
through it, the same number of times, in the same order: each is a collective.
Every rank of the group runs the same layers on its own batch, as ZeRO-3 already
requires; generation must keep the ranks in step (every rank generates until
all are done, as `synced_gpus` does), and so must anything that skips a layer
on one rank only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from zerodp.expert_parallel.all_to_all import Route, exchange_counts, exchange_rows
from zerodp.expert_parallel.expert_group import ExpertGroup
from zerodp.expert_parallel.record import ExpertSlice
from zerodp.expert_parallel.routing import (
    Assignments,
    expert_counts,
    local_expert_index,
    order_by_expert,
)

# The model's own experts forward on local rows: (rows, local index [R, 1], weights [R, 1]).
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dispatch_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    group: ExpertGroup,
    experts: ExpertSlice,
    local_forward: LocalExperts,
    params: Sequence[nn.Parameter],
) -> torch.Tensor:
    """The experts' output for this rank's tokens, computed where each expert lives (see
    [Note: expert-parallel dispatch]); a collective over `group`."""
    hidden, top_k = hidden_states.shape[-1], top_k_index.shape[-1]
    flat = hidden_states.reshape(-1, hidden)
    tokens = flat.shape[0]  # may be 0: a rank without tokens still takes part
    if top_k_weights.shape != top_k_index.shape or top_k_index.numel() != tokens * top_k:
        raise ValueError(
            f"the router's weights {tuple(top_k_weights.shape)} and indices "
            f"{tuple(top_k_index.shape)} do not name the same K slots of each of the "
            f"{tokens} tokens of hidden states {tuple(hidden_states.shape)}"
        )
    index = top_k_index.reshape(tokens, top_k)
    weights = top_k_weights.reshape(tokens, top_k)
    num_experts = experts.global_experts
    per_expert = expert_counts(index, num_experts)
    received = exchange_counts(per_expert, group.comm)
    route, count = _route(per_expert, received, group.size)
    assignments = order_by_expert(index, num_experts, count)
    rows = exchange_rows(flat[assignments.tokens], group.comm, route)
    local_index = local_expert_index(received, experts.local_experts)
    results = _local_results(rows, local_index, weights.dtype, local_forward, params)
    back = exchange_rows(results, group.comm, route.reversed())
    valid = (index >= 0) & (index < num_experts)
    out = _combine(back, assignments, torch.where(valid, weights, 0), tokens)
    return out.to(hidden_states.dtype).reshape(hidden_states.shape)


def _route(per_expert: torch.Tensor, received: torch.Tensor, size: int) -> tuple[Route, int]:
    """Rows to and from each rank, and how many assignments this rank sends (one host sync)."""
    both = torch.cat([per_expert.view(size, -1).sum(dim=1), received.sum(dim=1)]).tolist()
    send, receive = tuple(both[:size]), tuple(both[size:])
    return Route(send, receive), sum(send)


def _local_results(
    rows: torch.Tensor,
    local_index: torch.Tensor,
    weight_dtype: torch.dtype,
    local_forward: LocalExperts,
    params: Sequence[nn.Parameter],
) -> torch.Tensor:
    """Each received row through its local expert, by the model's own forward (K = 1, weight 1)."""
    if rows.shape[0] == 0:
        # The model's forward would read no expert tensor: touch each with an empty slice,
        # so that each still gets a (zero) gradient ([Note: expert-parallel dispatch]).
        touched = [p.view(-1)[:0].sum() for p in params if p.requires_grad]
        return rows + sum(touched, rows.new_zeros(()))
    ones = torch.ones((rows.shape[0], 1), dtype=weight_dtype, device=rows.device)
    return local_forward(rows, local_index.unsqueeze(-1), ones)


def _combine(
    back: torch.Tensor, assignments: Assignments, weights: torch.Tensor, tokens: int
) -> torch.Tensor:
    """Each token's K results, weighted by the router and summed on the token's own rank."""
    top_k = weights.shape[-1]
    per_slot = back.new_zeros((tokens * top_k, back.shape[-1]))
    per_slot = per_slot.index_copy(0, assignments.slots, back)
    weighted = per_slot.view(tokens, top_k, back.shape[-1]) * weights.unsqueeze(-1)
    return weighted.sum(dim=1)
