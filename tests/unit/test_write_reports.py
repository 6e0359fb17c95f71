"""The decoupled writer's reports through a store (`zerodp.checkpoint_io.write_reports`), without
a process group: two boards on one HashStore stand for two ranks' threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from zerodp.checkpoint_io.write_reports import RankReport, ReportBoard, Verdict
from zerodp.errors import CheckpointError, CheckpointStorageError


def _boards(deadline_s: float = 5.0) -> tuple[ReportBoard, ReportBoard, dist.HashStore]:
    store = dist.HashStore()
    return (
        ReportBoard(store, ".tmp.t.0123456789ab", 0, 2, deadline_s),
        ReportBoard(store, ".tmp.t.0123456789ab", 1, 2, deadline_s),
        store,
    )


def test_reports_and_the_verdict_go_round() -> None:
    zero, one, store = _boards()
    failure = CheckpointStorageError("rank 1's file '__1_0.distcp': No space left on device")
    heard: list[Verdict] = []
    one.post_report(RankReport(1, [], {}, failure))

    def other_rank() -> None:
        heard.append(one.hear_verdict())

    thread = threading.Thread(target=other_rank)
    thread.start()
    zero.post_report(RankReport(0, ["result"], {"rank0.json": {"size": 1, "hash": 2}}))
    reports = zero.collect_reports()
    assert [r.rank for r in reports] == [0, 1] and reports[0].results == ["result"]
    assert str(reports[1].error) == str(failure)
    zero.post_verdict(Verdict(reports[1].error))  # returns once rank 1 has read it
    thread.join(timeout=5)
    assert isinstance(heard[0].error, CheckpointStorageError)
    assert str(heard[0].error) == str(failure)
    assert store.num_keys() <= 1  # the save's keys are removed (a HashStore may keep a counter)
    assert Verdict.decode(Verdict(None).encode()).error is None


def test_a_rank_that_never_reports_is_named_at_the_deadline() -> None:
    zero, _, _ = _boards(deadline_s=0.3)
    zero.post_report(RankReport(0, [], {}))
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"1 missing after 0 s \(report/1\).*comms_timeout_s"):
        zero.collect_reports()
    assert time.monotonic() - start < 5


def test_a_store_that_fails_is_a_checkpoint_error() -> None:
    class GoneStore:
        def set(self, key: str, value: bytes) -> None:
            raise RuntimeError("Connection reset by peer")

    board = ReportBoard(GoneStore(), "x", 1, 2, 1.0)
    with pytest.raises(CheckpointError, match=r"store failed.*Connection reset by peer"):
        board.post_report(RankReport(1, [], {}))
