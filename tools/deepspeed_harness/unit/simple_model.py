"""`SimpleModel` and `random_dataloader` as DeepSpeed's test files use them (zerodp's own
code for the same behaviour: stacked Linear layers and a cross-entropy loss; random
features with random class labels in a plain DataLoader)."""

from __future__ import annotations

from typing import Any

import torch
from unit.common import preferred_dtype


class SimpleModel(torch.nn.Module):
    """`nlayers` Linear(hidden, hidden); with several, layer i also adds layer i // 2's output
    (DeepSpeed's shape, so parameters are used twice); the forward returns the loss."""

    def __init__(self, hidden_dim: int, empty_grad: bool = False, nlayers: int = 1) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(
            [torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)]
        )
        if empty_grad:
            self.linear2 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()
        self.empty_grad = empty_grad

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for index, layer in enumerate(self.linears):
                x = self.linears[index // 2](x) + layer(x)
        return self.cross_entropy_loss(x, y)


def random_dataset(
    total_samples: int, hidden_dim: int, device: Any, dtype: torch.dtype | None = None
) -> torch.utils.data.TensorDataset:
    dtype = dtype or preferred_dtype()
    features = torch.randn(total_samples, hidden_dim, device=device, dtype=dtype)
    labels = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    return torch.utils.data.TensorDataset(features, labels)


def random_dataloader(
    model: Any, total_samples: int, hidden_dim: int, device: Any, dtype: torch.dtype | None = None
) -> torch.utils.data.DataLoader:
    batch_size = model.train_micro_batch_size_per_gpu()
    dataset = random_dataset(total_samples, hidden_dim, device, dtype=dtype)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)
