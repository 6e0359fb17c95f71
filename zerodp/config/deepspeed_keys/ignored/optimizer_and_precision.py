"""Optimizer and precision keys without effect in zerodp: DeepSpeed's optimizer extras, and
fp16/bf16 settings for what zerodp always does one way (fp32 masters and optimizer
state, loss scaling under fp16 only).
"""

from __future__ import annotations

from zerodp.config.deepspeed_keys.ignored.entry import Ignored, equals
from zerodp.config.deepspeed_keys.kinds import BOOL, INT, NUMBER

FP16_ONLY = "bf16 needs no loss scaling (an fp16 key)"

OPTIMIZER_AND_PRECISION: tuple[Ignored, ...] = (
    Ignored("optimizer.legacy_fusion", BOOL, "zerodp uses torch.optim's implementations"),
    # --- precision -----------------------------------------------------------------------
    Ignored(
        "fp16.auto_cast",
        BOOL,
        "zerodp casts floating inputs to fp16",
        equals(True),
        "zerodp casts floating inputs to fp16 anyway (a forward pre-hook)",
    ),
    Ignored(
        "fp16.fp16_master_weights_and_grads",
        BOOL,
        "zerodp keeps fp32 master weights and gradients",
        equals(False),
        "zerodp keeps fp32 masters (2 + 2 + 12 bytes per parameter)",
    ),
    Ignored(
        "bf16.bf16_master_weights_and_grads",
        BOOL,
        "zerodp keeps fp32 master weights",
        equals(False),
        "zerodp keeps fp32 masters (2 + 2 + 12 bytes per parameter)",
    ),
    Ignored(
        "bf16.bf16_optimizer_states",
        BOOL,
        "zerodp keeps optimizer state in fp32",
        equals(False),
        "zerodp keeps optimizer state in fp32",
    ),
    Ignored(
        "bf16.immediate_grad_update",
        BOOL,
        "zerodp moves each gradient into its reduction buffer as it is produced",
    ),
    Ignored(
        "bf16.check_grad_overflow",
        BOOL,
        "zerodp checks for inf/NaN gradients under fp16 loss scaling only",
        equals(False),
        "zerodp does not check bf16 gradients for overflow",
    ),
    Ignored("bf16.loss_scale", NUMBER, FP16_ONLY),
    Ignored("bf16.initial_scale_power", INT, FP16_ONLY),
    Ignored("bf16.loss_scale_window", INT, FP16_ONLY),
    Ignored("bf16.hysteresis", INT, FP16_ONLY),
    Ignored("bf16.consecutive_hysteresis", BOOL, FP16_ONLY),
    Ignored("bf16.min_loss_scale", NUMBER, FP16_ONLY),
    Ignored("bf16.auto_cast", BOOL, "zerodp casts floating inputs to bf16"),
)
