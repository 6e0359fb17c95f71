"""Hugging Face models' attention, made sequence-parallel without registration by the user.

transformers looks up a model's attention function (and the function that
builds its mask) by the name in `config._attn_implementation`, in two global
interfaces. For each implementation a model uses (sdpa, eager, flash, flex,
...), zerodp registers a function of its own under `zerodp_sequence_<name>`
and points the model's text config at it (`switch_attention`; `destroy()`
points it back). The original name stays inside the new one, so transformers'
own checks ("is this flash attention?") still see it.

- Attention (`_attention_for`): during a sequence-parallel call (see [Note:
  sequence-parallel forwards]) the query, key and value go through the
  all-to-all to head shards of the whole sequence, the original function runs
  on them, and its output comes back to this rank's tokens (`attention.py`).
  Grouped-query attention with fewer key/value heads than S repeats them, and
  the module's `num_key_value_groups` is set to the local ratio during the
  call (eager and sdpa read it to expand key/value heads).
- Masks (`_mask_for`): the model builds its mask from the inputs it sees,
  which are one slice; in a SHARDED forward the mask is built for the whole
  padded sequence instead, from the whole padding mask and positions the
  input split kept, with the model's own mask pattern (causal, sliding window,
  ...), so the mask the original function gets is the one a single process
  would build. Packed sequences (positions that restart in a row, no padding
  mask) get transformers' packed-sequence mask from the whole row's positions.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from zerodp.errors import UsageError
from zerodp.sequence.all_to_all import heads_to_sequence
from zerodp.sequence.attention import to_head_shards
from zerodp.sequence.sequence_group import ForwardMode, SequenceGroup, group_of, sharded_now

PREFIX = "zerodp_sequence_"


def _interfaces() -> tuple[Any, Any, Any]:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface, AttentionMaskInterface, ALL_MASK_ATTENTION_FUNCTIONS


def registered_name(original: str) -> str:
    """Register zerodp's functions for `original` (once per process); the name they have."""
    if original.startswith(PREFIX):
        return original
    attention_interface, mask_interface, masks = _interfaces()
    name = PREFIX + original
    if name not in attention_interface._global_mapping:
        if original not in masks:
            raise UsageError(
                f"attention implementation {original!r} has no mask function in transformers' "
                "AttentionMaskInterface, so zerodp cannot build the whole sequence's mask for "
                'it; load the model with attn_implementation="sdpa" or "eager"'
            )
        mask_interface.register(name, _mask_for(masks[original]))
        attention_interface.register(name, _attention_for(original))
    return name


def _original_attention(original: str, module: nn.Module) -> Callable[..., Any]:
    if original != "eager":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[original]
    # "eager" is each model file's own function, not in the interface.
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise UsageError(
            f"{type(module).__name__} (in {type(module).__module__}) has no "
            "eager_attention_forward for zerodp to run sequence-parallel; load the model with "
            'attn_implementation="sdpa"'
        )
    return fn


@contextlib.contextmanager
def _key_value_groups(module: nn.Module, groups: int) -> Iterator[None]:
    before = getattr(module, "num_key_value_groups", None)
    if before is None or before == groups:
        yield
        return
    setattr(module, "num_key_value_groups", groups)  # noqa: B010 - an int attribute, not a module
    try:
        yield
    finally:
        setattr(module, "num_key_value_groups", before)  # noqa: B010


def _whole_positions(positions: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """Every rank's slice of `position_ids`, in token order (flash attention reads them)."""
    mine = positions.contiguous()
    every = torch.empty((group.size, *mine.shape), dtype=mine.dtype, device=mine.device)
    group.comm.all_gather(every.view(-1), mine.view(-1))
    return torch.cat(every.unbind(0), dim=-1)


def _attention_for(original: str) -> Callable[..., Any]:
    def attend(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        group = group_of(module)
        fn = _original_attention(original, module)
        if not group.parallel_attention:
            return fn(module, query, key, value, attention_mask, **kwargs)
        if kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
            raise UsageError(
                f"{type(module).__name__} passes per-head tensors (position_bias, sinks) to its "
                "attention function, which zerodp's sequence parallelism does not split by "
                "head yet; set sequence_parallel_size to 1 for this model"
            )
        if group.mode is ForwardMode.SHARDED:
            group.attention_calls += 1
        q, k, v = to_head_shards(group, query, key, value)
        positions = kwargs.get("position_ids")
        if "flash" in original and isinstance(positions, torch.Tensor):
            kwargs["position_ids"] = _whole_positions(positions, group)
        with _key_value_groups(module, q.shape[1] // k.shape[1]):
            out, _ = fn(module, q, k, v, attention_mask, **kwargs)
        # transformers' functions return (batch, tokens, heads, head_dim).
        return heads_to_sequence(out, group.comm, heads_dim=2, sequence_dim=1), None

    attend.__name__ = f"{PREFIX}{original}"
    return attend


def _mask_for(original: Callable[..., Any]) -> Callable[..., Any]:
    def mask(
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int = 0,
        kv_offset: int = 0,
        mask_function: Callable[..., Any] | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        group = sharded_now()
        if mask_function is not None:
            kwargs["mask_function"] = mask_function
        if group is None or group.full is None:
            return original(
                batch_size=batch_size,
                q_length=q_length,
                kv_length=kv_length,
                q_offset=q_offset,
                kv_offset=kv_offset,
                attention_mask=attention_mask,
                **kwargs,
            )
        full = group.full
        if full.attention_mask is None and full.positions_given:
            _with_packed_sequences(kwargs, full.position_ids, batch_size)
        return original(
            batch_size=batch_size,
            q_length=full.padded_length,
            kv_length=full.padded_length,
            q_offset=0,
            kv_offset=0,
            attention_mask=full.attention_mask,
            **kwargs,
        )

    return mask


def _with_packed_sequences(kwargs: dict[str, Any], positions: torch.Tensor, batch: int) -> None:
    """transformers' packed-sequence masking, from the whole rows' positions."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
        remap_positions_for_packed_sequence,
    )

    positions = positions.expand(batch, -1)
    packed = find_packed_sequence_indices(positions)
    if packed is None:
        return
    pattern = kwargs.get("mask_function", causal_mask_function)
    kwargs["mask_function"] = and_masks(
        remap_positions_for_packed_sequence(pattern, positions),
        packed_sequence_mask_function(packed),
    )
    kwargs["allow_is_causal_skip"] = False


class SwitchedAttention:
    """The text config of a model pointed at zerodp's functions; `remove()` points it back."""

    def __init__(self, model: nn.Module, group: SequenceGroup) -> None:
        config = _text_config(model)
        original = config._attn_implementation or "sdpa"
        heads = getattr(config, "num_attention_heads", None)
        # With tensor parallelism each rank holds heads / T of them, and those are what its
        # sequence group splits.
        tensor = group.dims.tensor_size
        if isinstance(heads, int) and heads % (group.size * tensor) != 0:
            held = (
                f"the model's {heads} attention heads"
                if tensor == 1
                else f"the {heads // tensor} attention heads each tensor-parallel rank holds "
                f"({heads} / tensor_parallel.autotp_size {tensor})"
            )
            raise UsageError(
                f"sequence_parallel_size {group.size} does not divide {held} (each rank "
                "attends with heads / sequence_parallel_size of them); choose a "
                "sequence_parallel_size that divides them"
            )
        if getattr(config, "is_causal", True) is False:
            raise UsageError(
                "sequence_parallel_size > 1 splits causal language models; this model's config "
                "says is_causal=False"
            )
        self._config = config
        self._original = original
        config._attn_implementation_internal = registered_name(original)

    def remove(self) -> None:
        self._config._attn_implementation_internal = self._original


def _text_config(model: nn.Module) -> Any:
    base = hf_model_in(model)
    config = base.config if base is not None else model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def hf_model_in(model: nn.Module) -> nn.Module | None:
    """The transformers model `model` is or wraps (a PEFT model's base model); else None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    if isinstance(model, PreTrainedModel):
        return model
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else None
    return base if isinstance(base, PreTrainedModel) else None
