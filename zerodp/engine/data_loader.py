"""The engine's data loader: each rank reads its own part of the data, resumably."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from zerodp.errors import UsageError


class ZeroDataLoader:
    """Iterates one epoch per `iter()`; `state_dict()` says where it is, for exact resume.

    Shuffling follows `DistributedSampler` with a fixed seed and the epoch
    number, so the order depends only on (seed, epoch, world size), and a
    resumed run skips the batches it had already consumed.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None,
        drop_last: bool,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        _check_size(dataset, micro_batch_size, world_size)
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.loader = DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            # Its own generator: starting an epoch must not draw from the global one
            # (which dropout uses), or a resumed run would diverge from a straight one.
            generator=torch.Generator().manual_seed(seed),
        )
        self.epoch = 0
        self.batches_consumed = 0  # in the current epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        skip = self.batches_consumed
        for index, batch in enumerate(self.loader):
            if index < skip:
                continue
            self.batches_consumed = index + 1
            yield batch
        self.epoch += 1
        self.batches_consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.batches_consumed = int(state["batches_consumed"])


def _check_size(dataset: Any, micro_batch_size: int, world_size: int) -> None:
    """A data set that cannot fill one micro-batch on every rank is refused at initialize
    (it would yield nothing, or one short batch, and `while global_steps < N` never ends)."""
    try:
        size = len(dataset)
    except TypeError:
        return  # an iterable data set: its length is unknown
    needed = micro_batch_size * world_size
    if size == 0:
        raise UsageError(
            "training_data is empty (0 samples); pass a data set with at least "
            f"{needed} samples (train_micro_batch_size_per_gpu {micro_batch_size} x world "
            f"size {world_size})"
        )
    if size < needed:
        raise UsageError(
            f"training_data has {size} samples, fewer than one micro-batch on every rank "
            f"(train_micro_batch_size_per_gpu {micro_batch_size} x world size {world_size} = "
            f"{needed}); lower train_micro_batch_size_per_gpu to at most "
            f"{max(1, size // world_size)}, or pass more data"
        )
