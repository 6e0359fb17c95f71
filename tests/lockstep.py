"""zerodp and the data-parallel reference driven in lockstep, compared as they go.

A `Lockstep` owns one zerodp engine and one `ReferenceDP` (computed in the test: a plain
model copy per rank, each backward's gradients averaged with an explicit all_reduce; under
bf16/fp16 the same recipe written out by hand). The test calls `forward`, `backward`,
`zero_grad` and `step` as it would on the engine; each call is mirrored on the reference,
every full gradient is compared after every backward, and after every optimizer step the
weights (fp32) or the fp32 masters and the bf16/fp16 parameters (mixed precision) are
compared (`zerodp.testing.parity`). Where the reference defers its reduction to the boundary
(mixed precision at stages 0 and 1 with accumulation), a gradient check compares zerodp's
full gradient with the reference's local sums averaged by an explicit all_reduce
(`ReferenceDP.reduced_grad`). Stage, accumulation and precision are read from the zerodp
config, so both sides always run the same recipe. `grad_comparisons` and
`param_comparisons` count the comparisons actually made, so that a test can assert them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerodp
from zerodp.testing import ReferenceDP
from zerodp.testing.parity import (
    assert_grads_match,
    assert_masters_match,
    assert_params_match,
    assert_working_params_match,
)
from zerodp.zero import ParamStatus, is_persistent, param_status

# The engine's gradient_clipping when the config leaves it out (DeepSpeed's: 1.0).
DEFAULT_CLIPPING = zerodp.ZeroDPConfig.model_fields["gradient_clipping"].default

# How the test runs a backward on zerodp: engine.backward(loss), a plain loss.backward(), or
# engine.scale(loss).backward(). The reference always runs a plain backward on its loss.
STYLES = ("engine_backward", "loss_backward", "scale_backward")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config_dtype(config: dict[str, Any]) -> str:
    """The precision a zerodp config dict asks for: "fp32", "bf16" or "fp16"."""
    for dtype in ("bf16", "fp16"):
        if config.get(dtype, {}).get("enabled", False):
            return dtype
    return "fp32"


def assert_all_released(model: nn.Module, stage: int, where: str = "") -> None:
    """No parameter is left in flight; at stage 3 every sharded one is released; every
    persistent one (every parameter at stages 0-2) is available."""
    for name, param in model.named_parameters():
        status = param_status(param)
        assert status is not ParamStatus.INFLIGHT, (where, name)
        if stage == 3 and not is_persistent(param):
            assert status is ParamStatus.NOT_AVAILABLE, (where, name, status)
        if is_persistent(param):
            assert status is ParamStatus.AVAILABLE, (where, name, status)


class Lockstep:
    """One zerodp engine and its data-parallel reference, run through the same calls.

    `model` is wrapped by zerodp; the reference trains `reference_model` (by default a deep
    copy of `model` taken before zerodp touches it) with `reference_optimizer`, an
    optimizer factory equivalent to the config's optimizer. `param_groups`, when given,
    builds the parameter groups for both sides. Tolerances default to those of the
    precision (`zerodp.testing.parity`); a test whose reference does exactly zerodp's
    operations passes `param_tolerance=BITWISE`.
    """

    def __init__(
        self,
        model: nn.Module,
        config: dict[str, Any],
        reference_optimizer: Callable[[Any], torch.optim.Optimizer],
        *,
        reference_model: nn.Module | None = None,
        param_groups: Callable[[nn.Module], Any] | None = None,
        style: str = "engine_backward",
        label: str = "",
        grad_tolerance: dict[str, float] | None = None,
        param_tolerance: dict[str, float] | None = None,
    ) -> None:
        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        self.model = model
        self.style = style
        self.stage = int(config["zero_optimization"]["stage"])
        self.gas = int(config.get("gradient_accumulation_steps", 1))
        self.clip = float(config.get("gradient_clipping", DEFAULT_CLIPPING))
        self.dtype = config_dtype(config)
        self.torch_dtype = TORCH_DTYPES[self.dtype]
        self.mixed = self.dtype != "fp32"
        self.rank = dist.get_rank()
        self.label = label or f"stage {self.stage}, {style}, gas {self.gas}"
        self.grad_tolerance = grad_tolerance or {}
        self.param_tolerance = param_tolerance or {}
        self.checks = 0  # gradient comparisons requested (after backward passes and by tests)
        self.grad_comparisons = 0  # made (each compares every gradient)
        self.param_comparisons = 0  # made after a step (each compares every weight)
        self.reference = ReferenceDP(
            reference_model if reference_model is not None else copy.deepcopy(model),
            reference_optimizer,
            param_groups,
            dtype=self.torch_dtype,
            # zerodp keeps accumulated gradients in fp32; one micro-batch stays in the dtype.
            grad_dtype=torch.float32 if self.gas > 1 else self.torch_dtype,
            # Mixed precision at stages 0 and 1 sums micro-batches locally (in fp32) and
            # reduces once, at the boundary; stages 2 and 3 reduce every micro-batch.
            defer_reduction=self.mixed and self.gas > 1 and self.stage in (0, 1),
        )
        self.ref_model = self.reference.model
        self.engine, _, _, _ = zerodp.initialize(
            model=model,
            config=config,
            model_parameters=param_groups(model) if param_groups is not None else None,
        )

    @property
    def scale(self) -> float:
        """What the reference's loss is multiplied by: 1/GAS and the fp16 loss scale, which
        zerodp applies to every backward, whatever its call style (to the loss, or to a plain
        loss.backward()'s gradients), as DeepSpeed does."""
        return self.engine.loss_scale / self.gas

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Both models' outputs, in fp32; the reference's floating inputs are cast to its dtype."""
        out = self.engine(*args, **kwargs).float()
        ref_args = [
            a.clone().to(self.torch_dtype) if torch.is_tensor(a) and a.is_floating_point() else a
            for a in args
        ]
        return out, self.ref_model(*ref_args, **kwargs).float()

    def backward(
        self, losses: tuple[torch.Tensor, torch.Tensor], retain_graph: bool = False
    ) -> None:
        """One backward on each side (zerodp's in this run's style); then every gradient."""
        loss, ref_loss = losses
        if self.style == "engine_backward":
            self.engine.backward(loss, retain_graph=retain_graph)
        elif self.style == "loss_backward":
            loss.backward(retain_graph=retain_graph)
        else:
            self.engine.scale(loss).backward(retain_graph=retain_graph)
        self.reference.run_backward(
            lambda: (ref_loss * self.scale).backward(retain_graph=retain_graph)
        )
        self.check("after a backward")

    def zero_grad(self) -> None:
        self.engine.zero_grad()
        self.reference.zero_grad()

    def step(self) -> bool:
        """engine.step(); at an accumulation boundary the reference steps too and the weights
        are compared. Returns whether this was a boundary."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        loss_scale = self.engine.loss_scale
        self.engine.step()
        if not boundary:
            return False
        if self.reference.defer_reduction:
            self.reference.reduce_local()
        if self.clip and not self.mixed:
            self.reference.clip(self.clip)  # fp32 clips the kept gradients; mixed, in step()
        stepped = self.reference.step(loss_scale=loss_scale, clip=self.clip if self.mixed else 0.0)
        assert stepped, f"{self.where('a step')}: the reference overflowed"
        self.reference.zero_grad()
        assert self.engine.skipped_steps == 0, f"{self.where('a step')}: zerodp skipped it"
        self.check_params("after a step")
        return True

    def check(self, what: str) -> None:
        """Every full gradient against the reference's (while the reference holds local sums,
        between the boundaries of a deferred reduction, against those sums averaged now)."""
        self.checks += 1
        loss_scale = self.engine.loss_scale if self.mixed else 1.0
        assert_grads_match(
            self.model,
            self.reference,
            self.where(what),
            loss_scale=loss_scale,
            **self.grad_tolerance,
        )
        self.grad_comparisons += 1

    def check_params(self, what: str) -> None:
        """fp32: every weight. Mixed precision: the fp32 masters and the bf16/fp16 weights."""
        where = self.where(what)
        if not self.mixed:
            assert_params_match(self.model, self.reference, where, **self.param_tolerance)
        else:
            assert_masters_match(self.model, self.reference, where, **self.param_tolerance)
            assert_working_params_match(self.model, self.reference, where, **self.param_tolerance)
        self.param_comparisons += 1

    def check_all_released(self) -> None:
        assert_all_released(self.model, self.stage, self.where("released"))

    def where(self, what: str) -> str:
        return f"{self.label}, check {self.checks}: {what}"

    def close(self) -> None:
        self.engine.destroy()
