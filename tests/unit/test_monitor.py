"""Monitoring sinks: CSV contents, rank-0-only writing, config handling, TensorBoard."""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

import pytest
import torch

from zerodp.config import MonitorConfig
from zerodp.monitor import (
    GRAD_NORM,
    LEARNING_RATE,
    TRAIN_LOSS,
    CSVSink,
    Event,
    Monitor,
    TensorBoardSink,
    TensorBoardUnavailableError,
    as_events,
    csv_file_name,
    eigenvalue_event_name,
)
from zerodp.monitor import sinks as sinks_module


def _rows(path: Path) -> list[list[str]]:
    with path.open(newline="") as handle:
        return list(csv.reader(handle))


def _config(tmp_path: Path, enabled: bool = True, job_name: str = "job") -> MonitorConfig:
    return MonitorConfig(enabled=enabled, output_path=str(tmp_path), job_name=job_name)


def _all_files(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file()]


def test_csv_sink_writes_header_and_rows_per_event_name(tmp_path: Path) -> None:
    sink = CSVSink(str(tmp_path), "job")
    sink.write_events(as_events([(TRAIN_LOSS, 2.5, 1), (LEARNING_RATE, 1e-3, 1)]))
    sink.write_events(as_events([(TRAIN_LOSS, 2.25, 2), (LEARNING_RATE, 9e-4, 2)]))
    sink.close()
    job_dir = tmp_path / "job"
    assert sorted(p.name for p in job_dir.iterdir()) == [
        "Train_Samples_lr.csv",
        "Train_Samples_train_loss.csv",
    ]
    assert _rows(job_dir / "Train_Samples_train_loss.csv") == [
        ["step", "value"],
        ["1", "2.5"],
        ["2", "2.25"],
    ]
    assert _rows(job_dir / "Train_Samples_lr.csv") == [
        ["step", "value"],
        ["1", "0.001"],
        ["2", "0.0009"],
    ]


def test_csv_rows_are_on_disk_before_close(tmp_path: Path) -> None:
    sink = CSVSink(str(tmp_path), "job")
    sink.write_events(as_events([(GRAD_NORM, 0.5, 7)]))
    assert _rows(sink.path_for(GRAD_NORM)) == [["step", "value"], ["7", "0.5"]]
    sink.close()


def test_csv_appends_across_sinks_without_repeating_the_header(tmp_path: Path) -> None:
    for step in (1, 2):
        sink = CSVSink(str(tmp_path), "job")
        sink.write_events(as_events([(TRAIN_LOSS, float(step), step)]))
        sink.close()
    assert _rows(tmp_path / "job" / "Train_Samples_train_loss.csv") == [
        ["step", "value"],
        ["1", "1.0"],
        ["2", "2.0"],
    ]


def test_file_names_from_event_names_stay_inside_the_job_dir() -> None:
    assert csv_file_name(TRAIN_LOSS) == "Train_Samples_train_loss.csv"
    assert csv_file_name(eigenvalue_event_name(3)) == "Train_Eigenvalues_3.csv"
    assert csv_file_name("../../etc/passwd") == "_._.._etc_passwd.csv"
    assert "/" not in csv_file_name("a/b\\c d:e")


def test_csv_names_that_would_share_a_file_are_rejected(tmp_path: Path) -> None:
    sink = CSVSink(str(tmp_path), "job")
    sink.write_events(as_events([("a/b", 1.0, 1)]))
    with pytest.raises(ValueError, match="rename one of them"):
        sink.write_events(as_events([("a_b", 2.0, 1)]))
    sink.close()


def test_monitor_from_config_writes_csv_on_rank_zero(tmp_path: Path) -> None:
    monitor = Monitor.from_config(_config(tmp_path), MonitorConfig(), rank=0)
    assert monitor.enabled
    monitor.write_events([(TRAIN_LOSS, torch.tensor(1.5), 3), Event(GRAD_NORM, 2, 3)])
    monitor.close()
    assert _rows(tmp_path / "job" / "Train_Samples_train_loss.csv")[1] == ["3", "1.5"]
    assert _rows(tmp_path / "job" / "Train_Samples_grad_norm.csv")[1] == ["3", "2.0"]


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    monitor = Monitor.from_config(_config(tmp_path), _config(tmp_path), rank=1)
    assert not monitor.enabled
    monitor.write_events([(TRAIN_LOSS, 1.0, 1)])
    monitor.close()
    assert list(tmp_path.iterdir()) == []


def test_disabled_config_writes_nothing(tmp_path: Path) -> None:
    off = _config(tmp_path, enabled=False)
    monitor = Monitor.from_config(off, off, rank=0)
    assert not monitor.enabled
    monitor.write_events([(TRAIN_LOSS, 1.0, 1)])
    monitor.close()
    assert list(tmp_path.iterdir()) == []


def test_empty_output_path_means_runs_in_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monitor = Monitor.from_config(MonitorConfig(enabled=True), None, rank=0)
    monitor.write_events([(TRAIN_LOSS, 1.0, 1)])
    monitor.close()
    assert (tmp_path / "runs" / "zerodp_job" / "Train_Samples_train_loss.csv").is_file()


def test_close_is_idempotent_and_later_events_are_dropped(tmp_path: Path) -> None:
    monitor = Monitor.from_config(_config(tmp_path), None, rank=0)
    monitor.write_events([(TRAIN_LOSS, 1.0, 1)])
    monitor.close()
    monitor.close()
    assert not monitor.enabled
    monitor.write_events([(TRAIN_LOSS, 2.0, 2)])
    assert len(_rows(tmp_path / "job" / "Train_Samples_train_loss.csv")) == 2
    sink = CSVSink(str(tmp_path), "other")
    sink.close()
    sink.close()
    with pytest.raises(ValueError, match="closed"):
        sink.write_events(as_events([(TRAIN_LOSS, 1.0, 1)]))


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ((TRAIN_LOSS, 1.0), r"\(name, value, step\) tuple"),
        (("", 1.0, 1), "non-empty str"),
        ((TRAIN_LOSS, "high", 1), "must be a number"),
        ((TRAIN_LOSS, torch.ones(2), 1), "must be a number"),
        ((TRAIN_LOSS, 1.0, 1.5), "must be an int"),
    ],
)
def test_malformed_events_raise_before_anything_is_written(
    tmp_path: Path, bad: tuple[object, ...], message: str
) -> None:
    monitor = Monitor.from_config(_config(tmp_path), None, rank=0)
    with pytest.raises(TypeError, match=message):
        monitor.write_events([(LEARNING_RATE, 1.0, 1), bad])  # type: ignore[list-item]
    monitor.close()
    assert _all_files(tmp_path) == []


def test_a_bare_event_tuple_gets_a_hint(tmp_path: Path) -> None:
    monitor = Monitor.from_config(_config(tmp_path), None, rank=0)
    with pytest.raises(TypeError, match="wrap a single event in a list"):
        monitor.write_events((TRAIN_LOSS, 1.0, 1))  # type: ignore[arg-type]
    monitor.close()


def test_missing_tensorboard_warns_once_and_keeps_csv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unavailable(output_path: str, job_name: str) -> TensorBoardSink:
        raise TensorBoardUnavailableError("TensorBoard logging needs: pip install tensorboard")

    monkeypatch.setattr(sinks_module, "TensorBoardSink", unavailable)
    monkeypatch.setattr(sinks_module._Warnings, "tensorboard_missing", False)
    with caplog.at_level(logging.WARNING, logger="zerodp.monitor.sinks"):
        first = Monitor.from_config(_config(tmp_path), _config(tmp_path), rank=0)
        second = Monitor.from_config(_config(tmp_path), _config(tmp_path), rank=0)
    assert [r.getMessage().count("pip install tensorboard") for r in caplog.records] == [1]
    assert [type(s) for s in first.sinks] == [CSVSink]
    first.close()
    second.close()


def test_tensorboard_sink_writes_an_event_file(tmp_path: Path) -> None:
    pytest.importorskip(
        "tensorboard", reason="tensorboard is an optional dependency and is not installed"
    )
    monitor = Monitor.from_config(None, _config(tmp_path, job_name="tb"), rank=0)
    assert [type(s) for s in monitor.sinks] == [TensorBoardSink]
    monitor.write_events([(TRAIN_LOSS, 1.0, 1), (TRAIN_LOSS, 0.5, 2)])
    monitor.close()
    monitor.close()
    event_files = [p for p in _all_files(tmp_path / "tb") if "tfevents" in p.name]
    assert len(event_files) == 1
    assert os.path.getsize(event_files[0]) > 0
