"""What training reports: model-state memory (and scalar events, in `events`/`sinks`)."""

from zerodp.monitor.events import (
    EIGENVALUE_PREFIX,
    GRAD_NORM,
    LEARNING_RATE,
    LOSS_SCALE,
    SAMPLES_PER_SEC,
    TRAIN_LOSS,
    Event,
    as_event,
    as_events,
    eigenvalue_event_name,
)
from zerodp.monitor.memory import (
    ModelStateBytes,
    ModelStateTensors,
    ideal_model_state_bytes,
    model_state_bytes,
    plain_model_state_bytes,
)
from zerodp.monitor.sinks import (
    DEFAULT_OUTPUT_PATH,
    CSVSink,
    Monitor,
    MonitorSettings,
    Sink,
    TensorBoardSink,
    TensorBoardUnavailableError,
    csv_file_name,
    log_dir,
)

__all__ = [
    "DEFAULT_OUTPUT_PATH",
    "EIGENVALUE_PREFIX",
    "GRAD_NORM",
    "LEARNING_RATE",
    "LOSS_SCALE",
    "SAMPLES_PER_SEC",
    "TRAIN_LOSS",
    "CSVSink",
    "Event",
    "ModelStateBytes",
    "ModelStateTensors",
    "Monitor",
    "MonitorSettings",
    "Sink",
    "TensorBoardSink",
    "TensorBoardUnavailableError",
    "as_event",
    "as_events",
    "csv_file_name",
    "eigenvalue_event_name",
    "ideal_model_state_bytes",
    "log_dir",
    "model_state_bytes",
    "plain_model_state_bytes",
]
