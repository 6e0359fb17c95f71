"""Small pure pieces of the reliability work: config keys, the timeout's sources, leftovers."""

from __future__ import annotations

import datetime

import pytest

import zerodp
from zerodp.checkpoint import paths
from zerodp.comm.group import comms_timeout
from zerodp.config import load_config


def test_the_new_config_keys_are_validated() -> None:
    config = load_config({"train_batch_size": 2, "comms_timeout_s": 10}, world_size=1)
    assert config.comms_timeout_s == 10 and config.on_non_finite == "warn"
    assert load_config({"train_batch_size": 2, "on_non_finite": "Skip"}, 1).on_non_finite == "skip"
    for bad, key in (
        ({"comms_timeout_s": 0}, "comms_timeout_s"),
        ({"on_non_finite": "x"}, "on_non_finite"),
    ):
        with pytest.raises(zerodp.ConfigError, match=key):
            load_config({"train_batch_size": 2, **bad}, world_size=1)


def test_the_timeout_comes_from_the_config_then_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("ZERODP_COMMS_TIMEOUT_S", raising=False)
    assert comms_timeout(None) is None  # torch's default for the backend
    assert comms_timeout(5.0) == datetime.timedelta(seconds=5)
    monkeypatch.setenv("ZERODP_COMMS_TIMEOUT_S", "12")
    assert comms_timeout(None) == datetime.timedelta(seconds=12)
    assert comms_timeout(3.0) == datetime.timedelta(seconds=3)
    monkeypatch.setenv("ZERODP_COMMS_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="ZERODP_COMMS_TIMEOUT_S"):
        comms_timeout(None)


def test_only_zerodp_s_own_temporary_entries_are_cleaned(tmp_path) -> None:
    ours = [paths.new_temp_name("t"), f".tmp.old.{paths.new_temp_name('t')[5:]}", ".tmp.latest.x1"]
    theirs = [".tmp.notes", ".tmp.t.not-an-id", "t", ".hidden"]
    for name in ours + theirs:
        (tmp_path / name).mkdir()
    assert sorted(paths.clean_leftovers(tmp_path)) == sorted(ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(theirs)
