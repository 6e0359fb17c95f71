"""What an engine with `sequence_parallel_size` > 1 holds: its sequence group, and the
switches it made to the model (removed again by `engine.destroy()`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zerodp.comm import Comm
from zerodp.parallel import ParallelDims, SequenceSlice
from zerodp.sequence import sequence_group as groups
from zerodp.sequence.hf_attention import SwitchedAttention, hf_model_in
from zerodp.sequence.hf_forward import SequenceForwardHooks
from zerodp.sequence.input_split import pad_to_slices
from zerodp.sequence.loss import sum_over_sequence
from zerodp.sequence.sequence_group import SequenceGroup


class SequenceParallel:
    """`engine.sequence_parallel`: the sequence group of this rank and what it splits.

    For a Hugging Face model (or a PEFT model around one) the attention is switched
    (`hf_attention`) and the forward split (`hf_forward`) at construction. Any other
    model calls `zerodp.sequence.sequence_parallel_attention(fn)` in its attention and
    splits its own inputs with `slice_of` / `split`.
    """

    def __init__(self, module: nn.Module, comm: Comm, dims: ParallelDims) -> None:
        self.group = SequenceGroup(comm, dims)
        self._model = module
        self._parts: list[Any] = []
        hf = hf_model_in(module)
        groups.bind(module, self.group)
        groups.activate(self.group)
        if hf is not None:
            self._parts.append(SwitchedAttention(hf, self.group))
            self._parts.append(SequenceForwardHooks(module, self.group))

    @property
    def size(self) -> int:
        """S: the ranks one sequence is split over."""
        return self.group.size

    @property
    def rank(self) -> int:
        """This rank's place in its sequence group (which slice it holds)."""
        return self.group.rank

    @property
    def comm(self) -> Comm:
        return self.group.comm

    @property
    def splits_forwards(self) -> bool:
        """Whether the engine splits the model's forward inputs itself (Hugging Face models)."""
        return bool(self._parts)

    def slice_of(self, length: int) -> SequenceSlice:
        """The tokens of a `length`-token sequence this rank holds (padded to S slices)."""
        return self.group.dims.sequence_slice(length)

    def split(self, tensor: torch.Tensor, pad_value: Any = 0, dim: int = 1) -> torch.Tensor:
        """This rank's slice of `tensor` along `dim` (the sequence), padded at the end first."""
        piece = self.slice_of(int(tensor.shape[dim]))
        padded = pad_to_slices(tensor, piece, pad_value, dim)
        return padded.narrow(dim, piece.start, piece.local_length)

    def sum(self, part: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `part` as the value, this rank's gradient (a loss's parts)."""
        return sum_over_sequence(part, self.group.comm)

    @contextlib.contextmanager
    def loss_parts(self) -> Iterator[None]:
        """Forwards inside return each rank's part of the loss as `.loss`, not the sum (for a
        caller that sums the values itself, as the HF Trainer integration does)."""
        before = self.group.sums_losses
        self.group.sums_losses = False
        try:
            yield
        finally:
            self.group.sums_losses = before

    def remove(self) -> None:
        for part in reversed(self._parts):
            part.remove()
        self._parts = []
        groups.unbind(self._model, self.group)
        groups.deactivate(self.group)
