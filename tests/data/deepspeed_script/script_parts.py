"""The model, data and config of `train.py`, shared with the test's reference.

`train.py` imports this file from its own folder (under DeepSpeed and under
zerodp alike); tests/distributed/test_deepspeed_script.py imports it to compute
the reference run in the test.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

INIT_SEED = 1234
NUM_SAMPLES = 64
NUM_FEATURES = 16
NUM_CLASSES = 4
LR = 1e-2

# DeepSpeed's getting-started config, as such scripts ship it: AdamW through torch_adam, no
# weight_decay and no gradient_clipping written, so both fall to DeepSpeed's defaults.
CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 1000,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
}


class SyntheticData(torch.utils.data.Dataset):
    """A fixed classification set (features, label), the same in every process."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(7)
        self.features = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=generator) * 3
        self.labels = torch.randint(0, NUM_CLASSES, (NUM_SAMPLES,), generator=generator)

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[index], self.labels[index]


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(NUM_FEATURES, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))
