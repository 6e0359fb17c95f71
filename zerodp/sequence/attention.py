"""Sequence-parallel attention: an attention function run on head shards of the full sequence.

`ulysses` wraps any attention function whose query, key and value are laid out
(batch, heads, tokens, head_dim) (torch's `scaled_dot_product_attention`,
flash-attn's and transformers' functions after their own transposes): the
query, key and value of this rank's tokens go through the all-to-all of
[Note: Ulysses all-to-all], the function runs on every token of heads / S
heads, and its output comes back to this rank's tokens. The function itself
is unchanged; a causal mask (`is_causal=True`) now covers the whole sequence,
and an explicit mask must be the whole sequence's (the HF path builds it:
`zerodp.sequence.hf_attention`).

Grouped-query attention: with fewer key/value heads than S (or a count S does
not divide), each key/value head is repeated so that every rank gets whole
heads, and rank s's query heads still meet the key/value heads they use: head
h of H uses key/value head h // (H / H_kv) before and after the repetition.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from zerodp.errors import UsageError
from zerodp.sequence.all_to_all import heads_to_sequence, sequence_to_heads
from zerodp.sequence.sequence_group import SequenceGroup, active_group


def key_value_repeats(num_heads: int, num_kv_heads: int, size: int) -> int:
    """How often each key/value head is repeated so that `size` ranks each get whole heads."""
    if num_heads % size != 0:
        raise UsageError(
            f"sequence_parallel_size {size} does not divide the model's {num_heads} attention "
            f"heads: each rank attends with heads / sequence_parallel_size of them; choose a "
            f"sequence_parallel_size that divides {num_heads}"
        )
    if num_kv_heads % size == 0:
        return 1
    if num_heads % num_kv_heads != 0:
        raise UsageError(
            f"{num_heads} query heads and {num_kv_heads} key/value heads: grouped-query "
            "attention needs a key/value head count that divides the query head count"
        )
    return size // math.gcd(num_kv_heads, size)


def to_head_shards(
    group: SequenceGroup, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, heads, local tokens, dim) each -> (batch, heads / S, all tokens, dim) each."""
    repeats = key_value_repeats(query.shape[1], key.shape[1], group.size)
    if repeats > 1:
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)
    comm = group.comm
    return (
        sequence_to_heads(query, comm),
        sequence_to_heads(key, comm),
        sequence_to_heads(value, comm),
    )


class UlyssesAttention:
    """`fn(query, key, value, *args, **kwargs)` on (batch, heads, tokens, dim) tensors, made
    sequence-parallel: called with this rank's tokens, it returns this rank's tokens of the
    attention over the whole sequence. See the module doc; `group` None: the sequence group
    of the engine built last with sequence_parallel_size > 1, looked up at each call."""

    def __init__(self, fn: Callable[..., torch.Tensor], group: Any = None) -> None:
        self.fn = fn
        self._group = group

    @property
    def group(self) -> SequenceGroup:
        if self._group is None:
            return active_group()
        return getattr(self._group, "group", self._group)  # an engine's SequenceParallel

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        group = self.group
        if not group.parallel_attention:
            return self.fn(query, key, value, *args, **kwargs)
        q, k, v = to_head_shards(group, query, key, value)
        out = self.fn(q, k, v, *args, **kwargs)
        return heads_to_sequence(out, group.comm, heads_dim=1, sequence_dim=2)


def sequence_parallel_attention(
    fn: Callable[..., torch.Tensor], group: Any = None
) -> UlyssesAttention:
    """Make an attention function of a model zerodp does not switch itself sequence-parallel.

        attend = zerodp.sequence.sequence_parallel_attention(F.scaled_dot_product_attention)
        out = attend(q, k, v, is_causal=True)   # q, k, v: (batch, heads, local tokens, dim)

    `fn` takes query, key and value as (batch, heads, tokens, head_dim) and returns the
    same layout (torch's `scaled_dot_product_attention` does). Each rank passes its own
    tokens (`engine.sequence_parallel.split(...)` cuts them); `is_causal=True` is then
    causal over the whole sequence, and an explicit mask must cover the whole sequence.
    `group`: `engine.sequence_parallel`, or None for the engine built last with
    sequence_parallel_size > 1. Hugging Face models need none of this: `initialize`
    switches their attention itself.
    """
    return UlyssesAttention(fn, group)
