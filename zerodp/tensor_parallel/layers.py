"""The split layers: a model's own `nn.Linear` / `nn.Embedding` modules, made tensor-parallel.

A module the plan names keeps its identity, its name and its parameters (the
same `nn.Parameter` objects, whose data become this rank's slice), so hooks,
optimizer references and state-dict names stay valid; only its class becomes
the parallel subclass here (the way FSDP2's `fully_shard` changes a module's
class), whose `forward` adds the group's communication
([Note: tensor-parallel communication]). The modules stay instances of
`nn.Linear` / `nn.Embedding`, and report their local sizes (`out_features`,
`in_features`, `num_embeddings`).

- `ColumnParallelLinear`: 1/T of the output features (weight rows, bias), the
  input copied in; with `gather_output` its outputs are gathered whole.
- `RowParallelLinear`: 1/T of the input features (weight columns); the partial
  products are all-reduced, then the whole bias is added once.
- `VocabParallelEmbedding`: 1/T of the rows (the vocabulary); ids outside this
  rank's rows give zeros, and the lookups are all-reduced.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from zerodp.tensor_parallel.communication import (
    TensorGroup,
    gather_from_group,
    reduce_from_group,
)


class ColumnParallelLinear(nn.Linear):
    """A Linear holding 1/T of its output features (see the module docstring)."""

    tensor_group: TensorGroup
    gather_output: bool

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = F.linear(self.tensor_group.copy_in(input), self.weight, self.bias)
        if self.gather_output:
            return gather_from_group(out, self.tensor_group)
        return out

    def extra_repr(self) -> str:
        group = self.tensor_group
        gathered = ", output gathered" if self.gather_output else ""
        return f"{super().extra_repr()}, column slice {group.rank} of {group.size}{gathered}"


class RowParallelLinear(nn.Linear):
    """A Linear holding 1/T of its input features (see the module docstring)."""

    tensor_group: TensorGroup

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = reduce_from_group(F.linear(input, self.weight), self.tensor_group)
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        group = self.tensor_group
        return f"{super().extra_repr()}, row slice {group.rank} of {group.size}"


class VocabParallelEmbedding(nn.Embedding):
    """An Embedding holding 1/T of its rows (see the module docstring)."""

    tensor_group: TensorGroup
    vocab_start: int  # the first row (id) this rank holds

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        start = self.vocab_start
        mine = (input >= start) & (input < start + self.num_embeddings)
        local = (input - start) * mine
        out = F.embedding(local, self.weight, self.padding_idx)
        # Ids held elsewhere looked up row 0: zero them, and their gradient with them.
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return reduce_from_group(out, self.tensor_group)

    def extra_repr(self) -> str:
        group = self.tensor_group
        return (
            f"{super().extra_repr()}, rows {self.vocab_start}.."
            f"{self.vocab_start + self.num_embeddings - 1} (slice {group.rank} of {group.size})"
        )


def make_column_parallel(module: nn.Linear, group: TensorGroup, *, gather_output: bool) -> None:
    """`module` (its weight rows and bias already sliced) becomes a `ColumnParallelLinear`."""
    module.__class__ = ColumnParallelLinear
    parallel = cast(ColumnParallelLinear, module)
    parallel.tensor_group = group
    parallel.gather_output = gather_output
    parallel.out_features = parallel.weight.shape[0]


def make_row_parallel(module: nn.Linear, group: TensorGroup) -> None:
    """`module` (its weight columns already sliced) becomes a `RowParallelLinear`."""
    module.__class__ = RowParallelLinear
    parallel = cast(RowParallelLinear, module)
    parallel.tensor_group = group
    parallel.in_features = parallel.weight.shape[1]


def make_vocab_parallel(module: nn.Embedding, group: TensorGroup, vocab_start: int) -> None:
    """`module` (its rows already sliced) becomes a `VocabParallelEmbedding`."""
    full_rows = module.num_embeddings
    pad = module.padding_idx
    module.__class__ = VocabParallelEmbedding
    parallel = cast(VocabParallelEmbedding, module)
    parallel.tensor_group = group
    parallel.vocab_start = vocab_start
    parallel.num_embeddings = parallel.weight.shape[0]
    if pad is not None:
        pad = pad if pad >= 0 else pad + full_rows
        inside = vocab_start <= pad < vocab_start + parallel.num_embeddings
        parallel.padding_idx = pad - vocab_start if inside else None
