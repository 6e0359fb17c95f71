"""The engine loader's global sample order: the same samples per optimizer step at any
number of data ranks, and a position saved at one world size resumed at another."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from zerodp.engine.data_loader import ZeroDataLoader
from zerodp.errors import CheckpointError, UsageError

N, MICRO, BATCH, SEED = 18, 1, 4, 3


def _loaders(data_ranks: int, drop_last: bool = False) -> list[ZeroDataLoader]:
    data = TensorDataset(torch.arange(N))
    return [
        ZeroDataLoader(
            data,
            micro_batch_size=MICRO,
            global_batch_size=BATCH,
            rank=index,
            world_size=data_ranks,
            collate_fn=None,
            drop_last=drop_last,
            seed=SEED,
        )
        for index in range(data_ranks)
    ]


def _steps(loaders: list[ZeroDataLoader], steps: int) -> list[list[int]]:
    """The samples of each optimizer step (its accumulation window, every rank's)."""
    accumulation = BATCH // (MICRO * len(loaders))
    iterators = [iter(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        samples: list[int] = []
        for _ in range(accumulation):
            for iterator in iterators:
                try:
                    samples += next(iterator)[0].tolist()
                except StopIteration:
                    raise AssertionError("an epoch ended inside a step") from None
        out.append(sorted(samples))
    return out


def _expected(steps: int, drop_last: bool = False) -> list[list[int]]:
    """Written out: epoch e is randperm(N) seeded with SEED + e, completed to whole global
    batches from its own start (or cut to them with drop_last)."""
    per_epoch = N // BATCH if drop_last else -(-N // BATCH)
    order: list[int] = []
    epoch = 0
    while len(order) < steps * BATCH:
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        order += (perm * 2)[: per_epoch * BATCH]
        epoch += 1
    return [sorted(order[k * BATCH : (k + 1) * BATCH]) for k in range(steps)]


@pytest.mark.parametrize("data_ranks", [1, 2, 4])
def test_every_step_reads_the_same_samples_at_any_number_of_data_ranks(data_ranks: int) -> None:
    per_epoch = -(-N // BATCH)
    loaders = _loaders(data_ranks)
    got = []
    for _ in range(2):  # two epochs, one `for batch in loader` each
        got += _steps(loaders, per_epoch)
        for loader in loaders:
            assert list(loader) == []  # the epoch is a whole number of steps
    assert got == _expected(2 * per_epoch)
    dropped = _loaders(data_ranks, drop_last=True)
    assert _steps(dropped, N // BATCH) == _expected(N // BATCH, drop_last=True)
    assert len(dropped[0]) == (N // BATCH) * BATCH // data_ranks


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 4), (4, 2)])
def test_a_position_saved_at_one_world_size_resumes_at_another(before: int, after: int) -> None:
    straight = _expected(8)
    first = _loaders(before)
    assert _steps(first, 3) == straight[:3]
    state = first[0].state_dict()
    assert state == {"epoch": 0, "samples_consumed": 3 * BATCH}
    second = _loaders(after)
    for loader in second:
        loader.check_state_dict(state, saved_world_size=before, world_size=after)
        loader.load_state_dict(state)
    got = _steps(second, 2)  # the rest of epoch 0
    for loader in second:
        assert list(loader) == []  # epoch 0 ends with step 5 at any world size
    got += _steps(second, 3)
    assert got == straight[3:8]


def test_a_position_inside_a_round_or_an_old_per_rank_count_is_refused() -> None:
    (loader,) = _loaders(1)
    two = _loaders(2)[0]
    with pytest.raises(CheckpointError, match="not a whole number of rounds of 1 x 2"):
        two.check_state_dict({"epoch": 0, "samples_consumed": 3}, 1, 2)
    # A checkpoint of an older zerodp counted each rank's batches: only at its world size.
    two.check_state_dict({"epoch": 0, "batches_consumed": 2}, 2, 2)
    with pytest.raises(CheckpointError, match="resume it at world size 2"):
        loader.check_state_dict({"epoch": 0, "batches_consumed": 2}, 2, 1)


def test_a_data_set_without_a_length_or_too_small_for_a_global_batch_is_refused() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(UsageError, match="has no length"):
        ZeroDataLoader(
            Stream(),
            micro_batch_size=1,
            rank=0,
            world_size=1,
            collate_fn=None,
            drop_last=False,
            seed=0,
        )
    with pytest.raises(UsageError, match="fewer than one global batch"):
        ZeroDataLoader(
            TensorDataset(torch.arange(3)),
            micro_batch_size=1,
            global_batch_size=4,
            rank=0,
            world_size=1,
            collate_fn=None,
            drop_last=True,
            seed=0,
        )
