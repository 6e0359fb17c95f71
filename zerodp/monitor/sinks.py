"""Where training events go: CSV files, TensorBoard, and the `Monitor` that fans out to them.

Only rank 0 writes: every rank computes the same scalars (the loss is
all-reduced, the learning rate is replicated), so one writer is enough and
N writers would race on the same files. `Monitor.from_config` therefore gives
other ranks a Monitor with no sinks, which drops events without any I/O.

The CSV sink needs nothing beyond the standard library and always works;
TensorBoard is optional, and a run whose config asks for it on a machine
without it logs one warning and carries on with the CSV sink rather than
failing hours into a job over a dashboard.
"""

from __future__ import annotations

import csv
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from zerodp.monitor.events import Event, as_events

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_PATH = "./runs"
"""Where logs go when a monitor config leaves `output_path` empty (relative to the cwd)."""

CSV_HEADER: tuple[str, str] = ("step", "value")

_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


class MonitorSettings(Protocol):
    """The shape of a monitor config block (`zerodp.config.MonitorConfig` has it)."""

    enabled: bool
    output_path: str
    job_name: str


class Sink(Protocol):
    """Anything that can record a batch of validated events."""

    def write_events(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...


class TensorBoardUnavailableError(ImportError):
    """TensorBoard logging was requested but the `tensorboard` package is not installed."""


def log_dir(output_path: str, job_name: str) -> Path:
    """`<output_path>/<job_name>`, with an empty output path meaning `./runs`."""
    if not job_name:
        raise ValueError("monitor job_name must be non-empty; set e.g. job_name='my_run'")
    return Path(output_path or DEFAULT_OUTPUT_PATH) / job_name


def csv_file_name(event_name: str) -> str:
    """The CSV file for one event name: "/" and other unsafe characters become "_".

    "Train/Samples/train_loss" is written to "Train_Samples_train_loss.csv".
    Leading dots are replaced too, so no name makes a hidden file.
    """
    stem = _UNSAFE_FILE_CHARS.sub("_", event_name)
    if stem.startswith("."):
        stem = "_" + stem[1:]
    return f"{stem}.csv"


class CSVSink:
    """One `step,value` CSV file per event name under `<output_path>/<job_name>/`.

    Files are opened in append mode, so a resumed run continues the same
    files (the header is written only to an empty file), and every batch is
    flushed, so a crash loses at most the batch being written.
    """

    def __init__(self, output_path: str, job_name: str) -> None:
        self.directory = log_dir(output_path, job_name)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, IO[str]] = {}
        self._writers: dict[str, Any] = {}
        self._owner_of_file: dict[str, str] = {}
        self._closed = False

    def path_for(self, event_name: str) -> Path:
        """The file events named `event_name` are appended to."""
        return self.directory / csv_file_name(event_name)

    def write_events(self, events: Sequence[Event]) -> None:
        if self._closed:
            raise ValueError("this CSVSink is closed; create a new one to keep logging")
        touched: dict[str, IO[str]] = {}
        for name, value, step in events:
            writer = self._writer_for(name)
            writer.writerow((step, repr(value)))
            touched[name] = self._files[name]
        for handle in touched.values():
            handle.flush()

    def _writer_for(self, event_name: str) -> Any:
        writer = self._writers.get(event_name)
        if writer is not None:
            return writer
        file_name = csv_file_name(event_name)
        owner = self._owner_of_file.setdefault(file_name, event_name)
        if owner != event_name:
            raise ValueError(
                f"monitor events {owner!r} and {event_name!r} would share the CSV file "
                f"{file_name!r}; rename one of them"
            )
        handle = open(self.directory / file_name, "a", newline="", encoding="utf-8")  # noqa: SIM115
        writer = csv.writer(handle)
        if handle.tell() == 0:
            writer.writerow(CSV_HEADER)
        self._files[event_name] = handle
        self._writers[event_name] = writer
        return writer

    def close(self) -> None:
        """Close every file; calling it again does nothing."""
        self._closed = True
        files, self._files, self._writers = self._files, {}, {}
        for handle in files.values():
            handle.close()


class TensorBoardSink:
    """Scalars through `torch.utils.tensorboard.SummaryWriter`, log dir `<output_path>/<job_name>`.

    Raises TensorBoardUnavailableError (an ImportError) when the tensorboard
    package is missing; `Monitor.from_config` turns that into a warning.
    """

    def __init__(self, output_path: str, job_name: str) -> None:
        self.directory = log_dir(output_path, job_name)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise TensorBoardUnavailableError(
                "TensorBoard logging needs the tensorboard package: pip install tensorboard "
                f"(or disable the tensorboard monitor) [{error}]"
            ) from error
        self._writer: Any = SummaryWriter(log_dir=str(self.directory))

    def write_events(self, events: Sequence[Event]) -> None:
        if self._writer is None:
            raise ValueError("this TensorBoardSink is closed; create a new one to keep logging")
        for name, value, step in events:
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; calling it again does nothing."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


class _Warnings:
    """Process-wide record of warnings already given, so each is logged once."""

    tensorboard_missing = False


class Monitor:
    """Fans each batch of events out to its sinks; with no sinks it drops events, doing no I/O.

    The engine should check `enabled` before computing event values: turning
    a device tensor into a float waits for the device, which an inactive
    monitor must not cost. After `close()` the monitor is disabled and
    further events are dropped.
    """

    def __init__(self, sinks: Iterable[Sink] = ()) -> None:
        self._sinks: list[Sink] = list(sinks)

    @classmethod
    def from_config(
        cls,
        csv_monitor: MonitorSettings | None,
        tensorboard: MonitorSettings | None,
        rank: int,
    ) -> Monitor:
        """Build the sinks the config enables, on rank 0 only (other ranks get an empty Monitor).

        An empty `output_path` means `./runs`. A missing tensorboard package
        logs a warning (once per process) and skips that sink.
        """
        if rank != 0:
            return cls()
        sinks: list[Sink] = []
        if csv_monitor is not None and csv_monitor.enabled:
            sinks.append(CSVSink(csv_monitor.output_path, csv_monitor.job_name))
        if tensorboard is not None and tensorboard.enabled:
            try:
                sinks.append(TensorBoardSink(tensorboard.output_path, tensorboard.job_name))
            except TensorBoardUnavailableError as error:
                if not _Warnings.tensorboard_missing:
                    _Warnings.tensorboard_missing = True
                    logger.warning("%s; TensorBoard monitoring is off for this run", error)
        return cls(sinks)

    @property
    def enabled(self) -> bool:
        """Whether events written now reach at least one sink."""
        return bool(self._sinks)

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return tuple(self._sinks)

    def write_events(self, events: Iterable[tuple[str, float, int]]) -> None:
        """Record `(name, value, step)` events; all are validated before any is written."""
        if not self._sinks:
            return
        checked = as_events(events)
        if not checked:
            return
        for sink in self._sinks:
            sink.write_events(checked)

    def close(self) -> None:
        """Close every sink; calling it again does nothing."""
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
