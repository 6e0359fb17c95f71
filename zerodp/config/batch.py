"""Batch-size arithmetic: train_batch_size = micro batch x accumulation steps x data ranks.

The data ranks are the ranks that read different samples: the world size, divided by
`sequence_parallel_size` (the ranks of a sequence group share their samples) and by
`tensor_parallel.autotp_size` (so do those of a tensor group), as DeepSpeed counts them
(see rule 5 of [Note: parallel dimensions] in `zerodp.parallel.dims`).

Kept apart from the models because it needs the world size, which is a fact
about the launch, not about the config file, and because it is pure integer
arithmetic that every rank must compute identically before any collective.
Every error shows the arithmetic that failed, so the fix is obvious.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerodp.errors import ConfigError
from zerodp.parallel import data_parallel_size

_TRAIN = "train_batch_size"
_MICRO = "train_micro_batch_size_per_gpu"
_GAS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The three batch sizes, all resolved and consistent with one world size."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def resolve_batch_sizes(
    train_batch_size: int | None,
    train_micro_batch_size_per_gpu: int | None,
    gradient_accumulation_steps: int | None,
    world_size: int,
    sequence_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
) -> BatchSizes:
    """Fill in whichever of the three sizes is missing, or check all three agree.

    Any two determine the third. With only `train_batch_size`, accumulation is
    1 and the micro batch is the per-rank share; with only the micro batch,
    accumulation is 1. The ranks counted are the data ranks (world size /
    (`sequence_parallel_size` x `tensor_parallel_size`)).
    """
    _check_positive("world size", world_size)
    ranks = data_parallel_size(world_size, sequence_parallel_size, tensor_parallel_size)
    for name, value in (
        (_TRAIN, train_batch_size),
        (_MICRO, train_micro_batch_size_per_gpu),
        (_GAS, gradient_accumulation_steps),
    ):
        if value is not None:
            _check_positive(name, value)

    t, m, g, w = (
        train_batch_size,
        train_micro_batch_size_per_gpu,
        gradient_accumulation_steps,
        ranks,
    )
    ranks_text = _ranks_text(w, world_size, sequence_parallel_size, tensor_parallel_size)
    if t is not None and m is not None and g is not None:
        if t != m * g * w:
            raise ConfigError(
                f"{_TRAIN} {t} != {_MICRO} {m} x {_GAS} {g} x {ranks_text} = {m * g * w}; "
                "fix one of the three"
            )
        return BatchSizes(t, m, g)
    if t is not None and m is not None:
        g = _divide(t, m * w, f"{_MICRO} {m} x {ranks_text}", f"or change {_MICRO}")
        return BatchSizes(t, m, g)
    if t is not None and g is not None:
        m = _divide(t, g * w, f"{_GAS} {g} x {ranks_text}", f"or change {_GAS}")
        return BatchSizes(t, m, g)
    if m is not None and g is not None:
        return BatchSizes(m * g * w, m, g)
    if t is not None:
        m = _divide(t, w, ranks_text, f"or set {_MICRO} and {_GAS}")
        return BatchSizes(t, m, 1)
    if m is not None:
        return BatchSizes(m * w, m, 1)
    raise ConfigError(
        f"batch size is not set: got {_GAS} {g} alone, which does not determine a batch size; "
        f"set {_TRAIN} or {_MICRO}"
        if g is not None
        else f"batch size is not set; set {_TRAIN} or {_MICRO}"
    )


def _ranks_text(data: int, world_size: int, sequence: int, tensor: int) -> str:
    """What the messages call the data ranks: the world size, or how it was divided."""
    divisors = [
        f"{name} {size}"
        for name, size in (
            ("sequence_parallel_size", sequence),
            ("tensor_parallel.autotp_size", tensor),
        )
        if size > 1
    ]
    if not divisors:
        return f"world size {data}"
    over = divisors[0] if len(divisors) == 1 else f"({' x '.join(divisors)})"
    return f"data-parallel size {data} (world size {world_size} / {over})"


def _divide(total: int, divisor: int, divisor_text: str, other_fix: str) -> int:
    """`total // divisor`, or an error showing the division that left a remainder."""
    quotient, remainder = divmod(total, divisor)
    if remainder:
        raise ConfigError(
            f"{_TRAIN} {total} is not divisible by {divisor_text} = {divisor} "
            f"({total} / {divisor} = {total / divisor:g}); "
            f"set {_TRAIN} to a multiple of {divisor} {other_fix}"
        )
    return quotient


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}: got {value!r}; allowed: an integer >= 1")
