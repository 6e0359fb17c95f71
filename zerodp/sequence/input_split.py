"""Splitting a Hugging Face-style batch along the sequence: what each rank's layers get.

Every rank of a sequence group is handed the same whole batch (the loader gives
them the same samples). A SHARDED forward (see [Note: sequence-parallel
forwards]) replaces the sequence-shaped inputs with this rank's slice (rule 5
of [Note: parallel dimensions]: L tokens padded to S x ceil(L / S) at the end)
and adds what the slice alone cannot know:

- `position_ids`: every token's position in the whole sequence (given ones are
  kept; otherwise 0 .. L-1), so rotary embeddings see global positions;
- `shift_labels`: the labels shifted by one before the split, so a slice's
  last target is the next slice's first token (see [Note: sequence-parallel
  loss]); `labels` gets the same slice, which the model's loss does not shift
  again when `shift_labels` is given;
- `num_items_in_batch`: the target tokens of the whole micro-batch, unless the
  caller passed it (the HF Trainer counts it over its accumulation window);
- `use_cache=False` unless given.

The padding is invisible: padded tokens come after every real token (causal
attention never reads them), their targets are -100, and a given padding mask
is extended with zeros. A batch that differs between the ranks of a group
would make them train on different sequences; one small all-gather of a
fingerprint per forward catches it before any all-to-all.
"""

from __future__ import annotations

from typing import Any

import torch

from zerodp.errors import UsageError
from zerodp.parallel import SequenceSlice
from zerodp.sequence.loss import count_targets, shift_labels
from zerodp.sequence.sequence_group import FullSequence, SequenceGroup

IGNORE_INDEX = -100
# Inputs of shape (batch, tokens, ...) that a causal LM's forward takes, and how each is
# padded: the ids repeat their last token, masks and embeddings pad with zeros, targets
# with IGNORE_INDEX.
SEQUENCE_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids")
TARGETS = ("labels", "shift_labels")


def wants_split(kwargs: dict[str, Any]) -> bool:
    """Whether a forward's inputs are split: it computes a loss (labels or shift_labels) and
    runs without a KV cache (generation runs whole on every rank)."""
    if all(kwargs.get(key) is None for key in TARGETS):
        return False
    if kwargs.get("use_cache") is True:
        return False
    return all(kwargs.get(key) is None for key in ("cache", "past_key_values"))


def split_batch(
    kwargs: dict[str, Any], group: SequenceGroup
) -> tuple[dict[str, Any], FullSequence]:
    """This rank's inputs for a SHARDED forward, and the whole sequence its masks need."""
    source = kwargs.get("input_ids")
    if source is None:
        source = kwargs.get("inputs_embeds")
    if not isinstance(source, torch.Tensor) or source.dim() < 2:
        raise UsageError(
            "a forward with labels under sequence parallelism needs input_ids (batch, tokens) "
            "or inputs_embeds (batch, tokens, hidden) to split along the sequence"
        )
    batch, length = int(source.shape[0]), int(source.shape[1])
    _refuse_unsplittable(kwargs, batch, length)
    _check_same_batch(kwargs, group)
    piece = group.dims.sequence_slice(length)
    out = dict(kwargs)
    given_labels = kwargs.get("shift_labels")
    shifted = given_labels if given_labels is not None else shift_labels(kwargs["labels"])
    if out.get("num_items_in_batch") is None:
        out["num_items_in_batch"] = count_targets(shifted, IGNORE_INDEX)
    local_targets = _local(pad_to_slices(shifted, piece, IGNORE_INDEX), piece)
    out["labels"] = out["shift_labels"] = local_targets
    positions = _positions(kwargs.get("position_ids"), length, source.device, piece)
    out["position_ids"] = _local(positions, piece)
    mask = kwargs.get("attention_mask")
    full_mask = None if mask is None else pad_to_slices(mask, piece, 0)
    for key in ("input_ids", "inputs_embeds", "token_type_ids"):
        value = kwargs.get(key)
        if value is not None:
            filler = value[:, -1:] if key == "input_ids" else 0
            out[key] = _local(pad_to_slices(value, piece, filler), piece)
    positions_given = kwargs.get("position_ids") is not None
    if full_mask is not None:
        out["attention_mask"] = _local(full_mask, piece)
    elif positions_given:
        # Without a padding mask, transformers looks for packed sequences in the positions it
        # gets; a slice's positions cannot tell (the whole sequence's can: see hf_attention).
        out["attention_mask"] = torch.ones_like(out["position_ids"]).expand(batch, -1)
    out.setdefault("use_cache", False)
    if out["use_cache"] is None:
        out["use_cache"] = False
    full = FullSequence(
        padded_length=piece.padded_length,
        attention_mask=None if full_mask is None else full_mask.bool(),
        position_ids=positions,
        positions_given=positions_given,
    )
    return out, full


def pad_to_slices(
    value: torch.Tensor, piece: SequenceSlice, filler: Any, dim: int = 1
) -> torch.Tensor:
    """`value` padded at the end of `dim` (the sequence) to S equal slices, with `filler`
    (a value, or a tensor of size 1 along `dim` repeated)."""
    if piece.padding == 0:
        return value
    shape = list((filler if isinstance(filler, torch.Tensor) else value).shape)
    shape[dim] = piece.padding
    if isinstance(filler, torch.Tensor):
        tail = filler.expand(*shape)
    else:
        tail = torch.full(shape, filler, dtype=value.dtype, device=value.device)
    return torch.cat([value, tail], dim=dim)


def _local(value: torch.Tensor, piece: SequenceSlice) -> torch.Tensor:
    return value[:, piece.start : piece.stop].contiguous()


def _positions(
    given: torch.Tensor | None, length: int, device: torch.device, piece: SequenceSlice
) -> torch.Tensor:
    """Every token's position, padded by counting on from the last one: (batch or 1, padded)."""
    if given is None:
        return torch.arange(piece.padded_length, device=device).unsqueeze(0)
    positions = given if given.dim() == 2 else given.unsqueeze(0)
    if piece.padding == 0:
        return positions
    steps = torch.arange(1, piece.padding + 1, device=positions.device, dtype=positions.dtype)
    return torch.cat([positions, positions[:, -1:] + steps], dim=1)


def _refuse_unsplittable(kwargs: dict[str, Any], batch: int, length: int) -> None:
    problems = []
    for key in (*SEQUENCE_INPUTS, *TARGETS, "position_ids"):
        value = kwargs.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key} is a {type(value).__name__}, not a tensor")
            continue
        shape = tuple(value.shape)
        leading = shape[:2] if value.dim() >= 2 else (1, *shape)
        wanted = (1, length) if key == "position_ids" else (batch, length)
        if key == "attention_mask" and value.dim() != 2:
            problems.append(
                f"attention_mask has shape {shape}; pass the 2D padding mask (batch, tokens): "
                "the engine builds the whole sequence's attention mask from it"
            )
        elif leading != wanted and not (key == "position_ids" and leading == (batch, length)):
            problems.append(f"{key} has shape {shape}, not (batch {batch}, tokens {length}, ...)")
    keep = kwargs.get("logits_to_keep")
    if keep is not None and not (isinstance(keep, int) and keep == 0):
        problems.append(
            f"logits_to_keep={keep!r}: the logits of a split sequence are each rank's slice; "
            "leave it at 0"
        )
    for key, value in kwargs.items():
        known = key in (*SEQUENCE_INPUTS, *TARGETS, "position_ids")
        shaped = isinstance(value, torch.Tensor) and tuple(value.shape[:2]) == (batch, length)
        if not known and shaped:
            problems.append(
                f"{key} has the batch's (batch, tokens) shape and zerodp does not know how "
                "to split it along the sequence"
            )
    if problems:
        raise UsageError(
            "sequence parallelism cannot split this forward's inputs: " + "; ".join(problems)
        )


def _fingerprint(kwargs: dict[str, Any], device: torch.device) -> torch.Tensor:
    """Sizes and position-weighted sums of the inputs: equal on ranks handed the same batch."""
    parts = []
    for key in (*SEQUENCE_INPUTS, *TARGETS, "position_ids"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            flat = value.detach().reshape(value.shape[0], -1).to(device, torch.float64)
            weights = torch.arange(1, flat.shape[-1] + 1, device=device, dtype=torch.float64)
            size = torch.tensor(float(value.numel()), dtype=torch.float64, device=device)
            parts.append(torch.stack([size, (flat * weights).sum()]))
        else:
            parts.append(torch.tensor([-1.0, 0.0], dtype=torch.float64, device=device))
    return torch.cat(parts)


def _check_same_batch(kwargs: dict[str, Any], group: SequenceGroup) -> None:
    source = kwargs.get("input_ids")
    if source is None:
        source = kwargs["inputs_embeds"]
    mine = _fingerprint(kwargs, source.device)
    every = torch.empty(mine.numel() * group.size, dtype=mine.dtype, device=mine.device)
    group.comm.all_gather(every, mine)
    rows = every.view(group.size, -1)
    if not bool((rows == rows[0]).all()):
        differ = [r for r in range(group.size) if not bool((rows[r] == rows[0]).all())]
        raise UsageError(
            "sequence parallelism: the ranks of a sequence group were handed different "
            f"batches (sequence ranks {differ} differ from rank 0 of the group); every rank of "
            "a sequence group must get the same whole-sequence batch: read the data with the "
            "engine's loader (initialize(training_data=...)) or shard it by "
            "engine.data_parallel_rank / engine.data_parallel_size, not by the global rank"
        )
