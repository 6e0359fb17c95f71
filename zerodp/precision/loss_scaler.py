"""fp16 loss scaling: a fixed scale, or a dynamic one that backs off on overflow.

Dynamic scaling (config `fp16.loss_scale` 0) starts at 2**initial_scale_power.
An overflowing step (inf or NaN in any rank's gradient; one decision agreed
by all ranks) is skipped. The scale halves once `hysteresis` overflows have
been seen since it last changed, never below `min_loss_scale`; an overflow
at the minimum raises, since training cannot make progress there. A clean
step that follows `loss_scale_window` clean steps in a row (since the last
overflow, or the start) doubles it and restores the hysteresis budget: with a
window of W the scale doubles at the (W + 1)-th, (2W + 1)-th, ... clean step,
when DeepSpeed's DynamicLossScaler does. With `consecutive_hysteresis`
(DeepSpeed's `fp16` key of that name) the budget is restored after every
clean step instead, so only overflows in a row count towards halving.
"""

from __future__ import annotations

from typing import Any

from zerodp.config import FP16Config
from zerodp.errors import CheckpointError, LossScaleError


class LossScaler:
    """The fp16 loss scale and its dynamic schedule (see the module docstring)."""

    def __init__(
        self,
        *,
        scale: float,
        dynamic: bool,
        window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
    ) -> None:
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.consecutive_hysteresis = consecutive_hysteresis
        self.hysteresis_left = hysteresis
        self.clean_steps = 0
        self.overflows = 0

    @classmethod
    def none(cls) -> LossScaler:
        """No scaling (fp32 and bf16): scale 1, no overflow checks."""
        return cls(scale=1.0, dynamic=False)

    @property
    def checks_overflow(self) -> bool:
        return self.dynamic or self.scale != 1.0

    def update(self, overflow: bool) -> None:
        if not overflow:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if self.dynamic and self.clean_steps > 0 and self.clean_steps % self.window == 0:
                self.scale *= 2.0
                self.hysteresis_left = self.hysteresis
            self.clean_steps += 1
            return
        self.overflows += 1
        self.clean_steps = 0
        if not self.dynamic:
            return
        if self.hysteresis_left > 1:
            self.hysteresis_left -= 1
            return
        if self.scale <= self.min_scale:
            raise LossScaleError(
                f"gradients overflow at the minimum loss scale ({self.min_scale:g}); training "
                "cannot progress: lower the learning rate, clip gradients, use bf16 instead of "
                "fp16, or lower fp16.min_loss_scale"
            )
        self.scale = max(self.scale / 2.0, self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "dynamic": self.dynamic,
            "hysteresis_left": self.hysteresis_left,
            "clean_steps": self.clean_steps,
            "overflows": self.overflows,
        }

    @staticmethod
    def check_state_dict(state: Any) -> None:
        """Raise CheckpointError unless `state` is a loss scaler's saved state."""
        numbers: dict[str, type | tuple[type, ...]] = {
            "scale": (int, float),
            "hysteresis_left": int,
            "clean_steps": int,
            "overflows": int,
        }
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint loss_scaler: expected a JSON object, got {state!r}")
        for key, kinds in numbers.items():
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise CheckpointError(
                    f"checkpoint loss_scaler '{key}': expected a number, got {value!r}; the "
                    "checkpoint's zerodp_state.json is damaged"
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows = int(state["overflows"])


def loss_scaler_from_config(fp16: FP16Config) -> LossScaler:
    if not fp16.enabled:
        return LossScaler.none()
    if fp16.loss_scale > 0:
        return LossScaler(scale=fp16.loss_scale, dynamic=False)
    return LossScaler(
        scale=2.0**fp16.initial_scale_power,
        dynamic=True,
        window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        min_scale=fp16.min_loss_scale,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )
