"""The training counters, saved with every checkpoint and restored exactly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from zerodp.errors import CheckpointError


@dataclass
class TrainState:
    """Counts of a run so far (DeepSpeed's names).

    global_steps: optimizer steps taken (accumulation boundaries passed).
    micro_steps: `engine.step()` calls, one per micro-batch.
    global_samples: samples consumed by all ranks together.
    skipped_steps: boundary steps skipped because fp16 gradients overflowed.
    """

    global_steps: int = 0
    micro_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    @staticmethod
    def check_state_dict(state: Any) -> None:
        """Raise CheckpointError unless `state` holds every counter as a non-negative int."""
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint counters: expected a JSON object, got {state!r}")
        for field in fields(TrainState):
            value = state.get(field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(
                    f"checkpoint counter '{field.name}': expected a non-negative integer, got "
                    f"{value!r}; the checkpoint's zerodp_state.json is damaged"
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        for field in fields(TrainState):
            setattr(self, field.name, int(state[field.name]))
