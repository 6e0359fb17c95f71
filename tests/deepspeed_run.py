"""The small run DeepSpeed trains for the checkpoint fixtures, and zerodp's tests continue.

`tools/make_deepspeed_fixtures.py` trains it with DeepSpeed at world size 2,
saves a checkpoint after `SAVED_AT` steps and records DeepSpeed's own next
`CONTINUED` steps; `tests/distributed/test_deepspeed_checkpoints.py` loads
that checkpoint into zerodp at world sizes 1, 2 and 3 and compares. Both
import this module, so the model, the parameter groups, the data and the
config are one definition.

Every optimizer step sees the same global batch of `GLOBAL_BATCH` samples,
split evenly over the ranks (6 divides by 1, 2 and 3): rank r of M gets
samples [r * 6 / M, (r + 1) * 6 / M). Each rank's loss is the mean over its
samples, and ranks average their gradients, so the step is the gradient of
the mean over all six samples at any world size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

GLOBAL_BATCH = 6
SAVED_AT = 3
CONTINUED = 3
DEEPSPEED_WORLD_SIZE = 2
STAGES = (1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")
# Fixtures also converted with DeepSpeed's ds_to_universal (stage, precision).
UNIVERSAL = ((1, "fp16"), (2, "fp32"), (3, "bf16"))


class FixtureNet(nn.Module):
    """Parameters of odd sizes (padding at every world size), one frozen, one buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 9)
        self.norm = nn.LayerNorm(9)
        self.mix = nn.Linear(9, 9, bias=False)
        self.head = nn.Linear(9, 3)
        self.mix.weight.requires_grad_(False)  # frozen: restored from the module's weights
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.embed(x)))
        h = h + 0.5 * self.mix(h)
        return self.head(h) + self.offset.to(h.dtype)


def build_model() -> FixtureNet:
    torch.manual_seed(0)
    return FixtureNet()


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two optimizer groups: matrices with weight decay, vectors without."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in trainable if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for n, p in trainable if p.dim() <= 1], "weight_decay": 0.0},
    ]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of optimizer step `step` (1-based), all ranks' samples."""
    generator = torch.Generator().manual_seed(7919 * step)
    x = torch.randn(GLOBAL_BATCH, 5, generator=generator)
    y = torch.randn(GLOBAL_BATCH, 3, generator=generator)
    return x, y


def rank_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    per_rank = GLOBAL_BATCH // world_size
    x, y = global_batch(step)
    return x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.float() - target).square().mean()


_SCHEDULERS: dict[int, dict[str, Any]] = {
    1: {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 5},
    },
    2: {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0.001,
            "warmup_max_lr": 0.02,
            "warmup_num_steps": 3,
            "total_num_steps": 8,
            "warmup_type": "linear",
        },
    },
    3: {
        "type": "WarmupCosineLR",
        "params": {"warmup_min_ratio": 0.1, "warmup_num_steps": 3, "total_num_steps": 8},
    },
}


def config(stage: int, precision: str, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config of the run, at `world_size` ranks (the batch split changes only)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.95]}},
        "scheduler": _SCHEDULERS[stage],
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        if stage == 1:
            # fp32 gradient accumulation makes DeepSpeed use its BF16_Optimizer at stage 1,
            # whose files lay the partitions out differently (padded) from the ZeRO optimizer's.
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    elif precision == "fp16":
        # A short window, so that the loss scale doubles inside the recorded continuation.
        cfg["fp16"] = {
            "enabled": True,
            "initial_scale_power": 8,
            "loss_scale_window": 2,
            "hysteresis": 2,
        }
    return cfg


def fixture_name(stage: int, precision: str) -> str:
    return f"stage{stage}_{precision}"


# The run as DeepSpeed-Chat or an HF Trainer starts it: its own torch optimizer and LR
# scheduler passed to deepspeed.initialize (the config names neither), and a client_state of
# every plain kind. `zerodp convert` must carry all of it over.
CLIENT_STAGE = 2
CLIENT_FIXTURE = "stage2_fp32_client"


def client_state() -> dict[str, Any]:
    """What the client run saves with `save_checkpoint(client_state=...)`."""
    return {
        "epoch": 4,
        "note": "fixture",
        "position": {"shard": 3, "offsets": (17, 42)},
        "running_mean": torch.tensor([0.25, -1.5]),
        "seen": [1, 2.5, "three"],
        "best": None,
        "done": False,
    }


def client_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model), lr=0.02, betas=(0.9, 0.95))


def client_scheduler(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def client_config(world_size: int) -> dict[str, Any]:
    """`config` without the optimizer and scheduler blocks (the run passes its own)."""
    cfg = config(CLIENT_STAGE, "fp32", world_size)
    del cfg["optimizer"], cfg["scheduler"]
    cfg["zero_allow_untested_optimizer"] = True
    return cfg
