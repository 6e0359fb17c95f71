"""The two checks tensor parallelism needs: the same batch on every rank of a tensor group,
and the parameters the plan leaves whole bitwise equal across it.

- `SameBatchCheck`: every rank of a tensor group must compute on the same
  samples (its all-reduces add up parts of one computation). The loader
  `initialize` returns hands them the same batches; batches a user feeds are
  checked once, at the first forward, as DeepSpeed does (a fingerprint of every
  input, compared across the tensor group). A difference is a `UsageError` on
  every rank, naming the inputs that differ.
- `ReplicaCheck`: a parameter the plan leaves whole gets the same gradient on
  every rank of a tensor group, and the same update, so it stays bitwise equal.
  The check compares a checksum of each one's bits across the group (two int64
  sums per tensor: one all-gather); a difference is a `DivergenceError` on every
  rank naming the parameters. The tests run it after every step;
  `tensor_parallel.verify_replicated` turns it on in training (a debug flag).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zerodp.comm import Comm
from zerodp.errors import DivergenceError, UsageError
from zerodp.tensor_parallel.communication import TensorGroup

_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(value: Any) -> Any:
    """A picklable summary of `value` that two ranks share exactly when their inputs are equal."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        return ("tensor", tuple(value.shape), str(value.dtype), digest)
    if isinstance(value, Mapping):
        return ("map", tuple((str(k), _fingerprint(v)) for k, v in sorted(value.items(), key=str)))
    if isinstance(value, list | tuple):
        return ("seq", tuple(_fingerprint(v) for v in value))
    if value is None or isinstance(value, bool | int | float | str):
        return ("value", repr(value))
    return ("object", type(value).__qualname__)


class SameBatchCheck:
    """Compares the inputs of the first forward across each tensor group (see module docstring)."""

    def __init__(self, group: TensorGroup, world: Comm, tensor_ranks: list[int]) -> None:
        self._group = group
        self._world = world
        self._tensor_ranks = tensor_ranks
        self.pending = True

    def on_forward_start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """At the first forward only: a collective over the world, on every rank."""
        if not self.pending:
            return
        self.pending = False
        named = {f"argument {i}": a for i, a in enumerate(args)} | dict(kwargs)
        mine = {name: _fingerprint(value) for name, value in named.items()}
        theirs = self._group.comm.all_gather_object(mine)
        differing = sorted(
            {
                name
                for other in theirs
                for name in set(mine) | set(other)
                if other.get(name) != mine.get(name)
            }
        )
        error = None
        if differing:
            error = UsageError(
                f"the ranks of tensor-parallel group {self._tensor_ranks} got different inputs "
                f"at their first forward ({', '.join(differing)} differ): every rank of a "
                "tensor group computes on the same samples. Use the data loader "
                "zerodp.initialize(training_data=...) returns, or give each rank the batch of "
                "its data index (engine.comms.dims.data_index, of data_size)"
            )
        self._world.raise_if_any_failed(error)


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of `tensor`'s bits (plain, and weighted by position): equal bits give
    equal sums; a changed, swapped or moved element almost surely changes one of them."""
    flat = tensor.detach().contiguous().reshape(-1)
    bits = flat.view(_INTEGER_OF_SIZE[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


class ReplicaCheck:
    """Whether the whole (unsplit) parameters are bitwise equal across the tensor group."""

    def __init__(
        self,
        group: TensorGroup,
        world: Comm,
        values: Callable[[], list[tuple[str, torch.Tensor]]],
    ) -> None:
        self._group = group
        self._world = world
        self._values = values

    def check(self, where: str) -> int:
        """Compare every rank's checksums (a collective); returns how many tensors were compared.

        Raises `DivergenceError` on every rank when any differs.
        """
        values = self._values()
        if not values:  # the same on every rank: the model's structure is the same
            return 0
        sums = torch.stack([checksum(t) for _, t in values])
        gathered = torch.empty(
            (self._group.size, *sums.shape), dtype=sums.dtype, device=sums.device
        )
        self._group.comm.all_gather(gathered.view(-1), sums.reshape(-1))
        differs = (gathered != sums.unsqueeze(0)).any(dim=2).any(dim=0)
        bad = [name for (name, _), wrong in zip(values, differs.tolist(), strict=True) if wrong]
        error = None
        if bad:
            error = DivergenceError(
                f"{where}: parameters the tensor-parallel plan leaves whole differ across the "
                f"tensor group ({', '.join(bad[:8])}{', ...' if len(bad) > 8 else ''}); every "
                "rank of a tensor group must get the same batch and the same updates"
            )
        self._world.raise_if_any_failed(error)
        return len(values)
