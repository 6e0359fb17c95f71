"""The engine's data loader: each rank reads its own part of one global order, resumably."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from zerodp.engine.sample_order import SampleOrder
from zerodp.errors import CheckpointError, UsageError


class _RankSampler(Sampler[int]):
    """The rank's samples of the loader's current epoch, from where the loader stands."""

    def __init__(self, loader: ZeroDataLoader) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[int]:
        loader = self._loader
        start = loader.batches_consumed * loader.micro_batch_size * loader.data_size
        indices = loader.order.rank_indices(
            loader.epoch, start, loader.data_index, loader.data_size
        )
        return iter(indices)

    def __len__(self) -> int:
        loader = self._loader
        return loader.order.epoch_length // loader.data_size


class ZeroDataLoader:
    """Iterates one epoch per `iter()`; `state_dict()` says where it is, for exact resume.

    The samples come in one global order that does not depend on the number of data
    ranks, and the position a checkpoint keeps is global, so a run resumed at another
    world size reads what the uninterrupted run would have read (see [Note: the global
    sample order] in `zerodp.engine.sample_order`).
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
        global_batch_size: int | None = None,
    ) -> None:
        """`rank` and `world_size` are the data index and the number of data ranks;
        `global_batch_size` is `train_batch_size` (default: one micro-batch per data rank)."""
        size = _check_size(dataset, micro_batch_size, world_size)
        self.micro_batch_size = micro_batch_size
        self.data_index = rank
        self.data_size = world_size
        global_batch = global_batch_size or micro_batch_size * world_size
        self.order = SampleOrder(size, global_batch, seed, shuffle, drop_last)
        self.loader = DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=_RankSampler(self),
            collate_fn=collate_fn,
            # Its own generator: starting an epoch must not draw from the global one
            # (which dropout uses), or a resumed run would diverge from a straight one.
            generator=torch.Generator().manual_seed(seed),
        )
        self.epoch = 0
        self.batches_consumed = 0  # this rank's micro-batches in the current epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        skip = self.batches_consumed
        for index, batch in enumerate(self.loader, start=skip):
            self.batches_consumed = index + 1
            yield batch
        self.epoch += 1
        self.batches_consumed = 0

    @property
    def samples_consumed(self) -> int:
        """Global positions of the current epoch read by every rank together."""
        return self.batches_consumed * self.micro_batch_size * self.data_size

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples_consumed": self.samples_consumed}

    def check_state_dict(
        self, state: dict[str, int], saved_world_size: int, world_size: int
    ) -> None:
        """Raise `CheckpointError` unless `state` (a checkpoint's position, saved by
        `saved_world_size` ranks) can be resumed by this run of `world_size`; changes
        nothing."""
        if "samples_consumed" in state:
            try:
                self.order.check_round(
                    state["samples_consumed"], self.micro_batch_size, self.data_size
                )
            except UsageError as error:
                raise CheckpointError(str(error)) from None
            return
        if "batches_consumed" not in state:
            raise CheckpointError(
                "checkpoint dataloader: neither 'samples_consumed' nor 'batches_consumed' in "
                "it; the checkpoint's zerodp_state.json is damaged"
            )
        # Written by a zerodp before the global order: batches per rank, at its world size.
        if saved_world_size != world_size:
            raise CheckpointError(
                f"the checkpoint's data-loader position counts the batches of each of its "
                f"{saved_world_size} ranks (a checkpoint of an older zerodp): resume it at "
                f"world size {saved_world_size} and save again, then resize"
            )

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        if "samples_consumed" in state:
            consumed = int(state["samples_consumed"])
            self.batches_consumed = self.order.check_round(
                consumed, self.micro_batch_size, self.data_size
            )
        else:
            self.batches_consumed = int(state["batches_consumed"])


def _check_size(dataset: Any, micro_batch_size: int, data_size: int) -> int:
    """The data set's size. One that cannot fill one micro-batch on every rank is refused
    at initialize (it would yield nothing, or one short batch, and `while global_steps < N`
    never ends); so is one without a length (the global order needs it)."""
    try:
        size = len(dataset)
    except TypeError:
        raise UsageError(
            f"training_data ({type(dataset).__name__}) has no length: the engine's loader "
            "reads one global order of a map-style data set (see docs/multi-node.md); pass "
            "one, or build your own DataLoader over an iterable data set"
        ) from None
    needed = micro_batch_size * data_size
    if size == 0:
        raise UsageError(
            "training_data is empty (0 samples); pass a data set with at least "
            f"{needed} samples (train_micro_batch_size_per_gpu {micro_batch_size} x "
            f"{data_size} data ranks)"
        )
    if size < needed:
        raise UsageError(
            f"training_data has {size} samples, fewer than one micro-batch on every rank "
            f"(train_micro_batch_size_per_gpu {micro_batch_size} x {data_size} data ranks = "
            f"{needed}); lower train_micro_batch_size_per_gpu to at most "
            f"{max(1, size // data_size)}, or pass more data"
        )
    return size
