"""What training reports: model-state memory (and scalar events, in `events`/`sinks`)."""

from zerodp.monitor.memory import (
    ModelStateBytes,
    engine_model_state_bytes,
    ideal_model_state_bytes,
    plain_model_state_bytes,
)

__all__ = [
    "ModelStateBytes",
    "engine_model_state_bytes",
    "ideal_model_state_bytes",
    "plain_model_state_bytes",
]
