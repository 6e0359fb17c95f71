"""A sequence group as attention sees it: its `Comm`, and what the running forward is.

[Note: sequence-parallel forwards]
The ranks of a sequence group run the same model on disjoint slices of the same
sequences; attention alone needs every token, and gets it through the
all-to-alls of [Note: Ulysses all-to-all]. Whether an attention call is
sequence-parallel is decided by the forward it belongs to (`ForwardMode`):

- SHARDED: a forward of the engine's model whose inputs the engine split
  (`zerodp.sequence.hf_forward`): every layer sees this rank's slice.
- WHOLE: a forward the engine left whole on every rank (generation with a KV
  cache, a forward without labels under `torch.no_grad()`): plain attention.
- OUTSIDE: no forward of the model is running. Attention then runs when a
  checkpointed layer is recomputed during backward (its forward was SHARDED:
  a WHOLE forward with gradients is refused), or when a model the engine does
  not split calls a wrapped attention function itself
  (`sequence_parallel_attention`): sequence-parallel.

The mode is changed only by the root module's forward hooks, which restore the
previous mode when a forward ends, also when it raises.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from zerodp.comm import Comm
from zerodp.errors import UsageError
from zerodp.parallel import ParallelDims


class ForwardMode(enum.Enum):
    OUTSIDE = "outside"
    SHARDED = "sharded"
    WHOLE = "whole"


@dataclass(frozen=True)
class FullSequence:
    """What a SHARDED forward's attention mask is built from: the whole padded sequence.

    `attention_mask`: the user's 2D padding mask, padded with zeros (None: no padding
    mask); `position_ids`: every token's position, (batch or 1, padded length);
    `positions_given`: the caller passed them (they may restart inside a row: packed
    sequences).
    """

    padded_length: int
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    positions_given: bool


class SequenceGroup:
    """The sequence group of one engine (S ranks), and the state of its model's forward."""

    def __init__(self, comm: Comm, dims: ParallelDims) -> None:
        if comm.world_size != dims.sequence_size:
            raise RuntimeError(
                f"internal error: a sequence group Comm of {comm.world_size} ranks for "
                f"sequence_parallel_size {dims.sequence_size}"
            )
        self.comm = comm
        self.dims = dims
        self.mode = ForwardMode.OUTSIDE
        self.full: FullSequence | None = None  # set while mode is SHARDED
        self.attention_calls = 0  # sequence-parallel attention calls in this SHARDED forward
        self.sums_losses = True  # a forward's `.loss` is summed over the group (loss.py)

    @property
    def size(self) -> int:
        return self.dims.sequence_size

    @property
    def rank(self) -> int:
        return self.dims.sequence_rank

    @property
    def parallel_attention(self) -> bool:
        """Whether attention called now is sequence-parallel (see the Note above)."""
        return self.mode is not ForwardMode.WHOLE

    def to_sharded(self, full: FullSequence) -> None:
        self.mode, self.full, self.attention_calls = ForwardMode.SHARDED, full, 0
        _SHARDED_NOW.append(self)

    def to_whole(self) -> None:
        self.mode, self.full = ForwardMode.WHOLE, None

    def restore(self, mode: ForwardMode, full: FullSequence | None) -> None:
        """Back to the mode a forward started from (its hooks' `always_call` post-hook)."""
        if self.mode is ForwardMode.SHARDED and _SHARDED_NOW and _SHARDED_NOW[-1] is self:
            _SHARDED_NOW.pop()
        self.mode, self.full = mode, full


# Which group each model's modules belong to: attention functions are registered once per
# process (transformers' interfaces are global), the modules tell them whose call it is.
_GROUP_OF: weakref.WeakKeyDictionary[nn.Module, SequenceGroup] = weakref.WeakKeyDictionary()
# The groups whose model runs a SHARDED forward now, innermost last: attention masks are
# built (by the model, before its layers run) for the innermost one's full sequence.
_SHARDED_NOW: list[SequenceGroup] = []
# The group of the engine built last with sequence_parallel_size > 1, for attention
# functions wrapped without naming one (`sequence_parallel_attention(fn)`).
_ACTIVE: list[SequenceGroup] = []


def bind(model: nn.Module, group: SequenceGroup) -> None:
    for module in model.modules():
        _GROUP_OF[module] = group


def unbind(model: nn.Module, group: SequenceGroup) -> None:
    for module in model.modules():
        if _GROUP_OF.get(module) is group:
            del _GROUP_OF[module]


def group_of(module: nn.Module) -> SequenceGroup:
    group = _GROUP_OF.get(module)
    if group is None:
        raise UsageError(
            f"{type(module).__name__} calls zerodp's sequence-parallel attention but belongs "
            "to no engine with sequence_parallel_size > 1 (a module added after "
            "zerodp.initialize?); build the model completely before initialize"
        )
    return group


def activate(group: SequenceGroup) -> None:
    _ACTIVE.append(group)


def deactivate(group: SequenceGroup) -> None:
    if group in _ACTIVE:
        _ACTIVE.remove(group)


def active_group() -> SequenceGroup:
    if not _ACTIVE:
        raise UsageError(
            "a sequence-parallel attention function ran, but no engine with "
            'sequence_parallel_size > 1 exists; call zerodp.initialize with "sequence_parallel_'
            'size" in the config first, or pass group=engine.sequence_parallel'
        )
    return _ACTIVE[-1]


def sharded_now() -> SequenceGroup | None:
    """The group whose model is inside a SHARDED forward now (None: no such forward)."""
    return _SHARDED_NOW[-1] if _SHARDED_NOW else None
