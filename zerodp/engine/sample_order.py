"""One global order of the samples, the same at any number of data ranks.

[Note: the global sample order]
A run that resumes at another world size must train on the samples the
uninterrupted run would have: optimizer step k averages the gradients of the
same `train_batch_size` (B) samples whatever D (the data ranks) is. So the
order is defined globally and each rank only reads its part of it:

- epoch e is a permutation of the N samples drawn from a generator seeded with
  `seed + e` (`torch.randperm`, as `DistributedSampler` draws it), or 0..N-1
  unshuffled;
- an epoch is a whole number of global batches: ceil(N / B), completed from the
  epoch's own start (`dataloader_drop_last` false), or floor(N / B), the rest
  left out (true). So epochs and optimizer steps start together, and the
  epoch's length does not depend on D;
- the epoch is read in rounds of m x D positions (m: the micro-batch); in a
  round, the rank with data index d reads positions d, d + D, ... (m of them),
  which is `DistributedSampler`'s interleaving. A round is one micro-step of
  every rank, and the A = B / (m D) rounds of an accumulation window cover
  exactly the B positions of one global batch, at any D.

The position a run has reached is global (samples consumed in the epoch), so a
checkpoint saved by D ranks resumes with D' ranks at the same sample, as long
as the position is a whole number of the new rounds (at an optimizer step's
boundary it always is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerodp.errors import UsageError


@dataclass(frozen=True)
class SampleOrder:
    """The global order of `num_samples` samples read in global batches of `global_batch`."""

    num_samples: int
    global_batch: int
    seed: int
    shuffle: bool
    drop_last: bool

    def __post_init__(self) -> None:
        if self.drop_last and self.num_samples < self.global_batch:
            raise UsageError(
                f"training_data has {self.num_samples} samples, fewer than one global batch "
                f"(train_batch_size {self.global_batch}) with dataloader_drop_last true: "
                "no batch would be left; pass more data, a smaller train_batch_size, or "
                "dataloader_drop_last false"
            )

    @property
    def epoch_length(self) -> int:
        """Positions in one epoch: a whole number of global batches."""
        batches = self.num_samples // self.global_batch
        if not self.drop_last:
            batches = -(-self.num_samples // self.global_batch)
        return batches * self.global_batch

    def epoch(self, epoch: int) -> list[int]:
        """The sample index at each position of `epoch`."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        length = self.epoch_length
        if length <= len(order):
            return order[:length]
        repeats = -(-length // len(order))
        return (order * repeats)[:length]

    def rank_indices(self, epoch: int, start: int, data_index: int, data_size: int) -> list[int]:
        """The samples the rank with `data_index` of `data_size` reads in `epoch` from global
        position `start` (a whole number of rounds), in order."""
        return self.epoch(epoch)[start + data_index :: data_size]

    def check_round(self, consumed: int, micro_batch: int, data_size: int) -> int:
        """Rounds of `micro_batch` x `data_size` in `consumed` positions; an error when the
        position falls inside a round (a resume mid-step at another world size)."""
        per_round = micro_batch * data_size
        if consumed % per_round or consumed > self.epoch_length:
            raise UsageError(
                f"the data loader stopped after {consumed} samples of its epoch, which is not a "
                f"whole number of rounds of {micro_batch} x {data_size} data ranks: resume "
                "from a checkpoint saved at an optimizer step's boundary (any world size), "
                "or at the world size that saved it"
            )
        return consumed // per_round
