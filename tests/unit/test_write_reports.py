"""The decoupled writer's reports through a store (`zerodp.checkpoint_io.write_reports`), without
a process group: two boards on one HashStore stand for two ranks' threads. Every rank ends a
save with the same verdict, whatever the timing ([Note: one verdict per save])."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from zerodp.checkpoint_io.write_reports import RankReport, ReportBoard, Verdict, verdict_wait_s
from zerodp.errors import CheckpointError, CheckpointStorageError


def _boards(deadline_s: float = 5.0) -> tuple[ReportBoard, ReportBoard, dist.HashStore]:
    store = dist.HashStore()
    return (
        ReportBoard(store, ".tmp.t.0123456789ab", 0, 2, deadline_s),
        ReportBoard(store, ".tmp.t.0123456789ab", 1, 2, deadline_s),
        store,
    )


def _result() -> WriteResult:
    """DCP's record of one chunk a rank wrote."""
    return WriteResult(
        MetadataIndex("layer.weight", torch.Size([4, 0]), 1),
        24,
        _StorageInfo("__1_0.distcp", 16, 24),
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
    zero.post_report(RankReport(0, [_result()], {"rank0.json": {"size": 1, "hash": 2}}))
    reports = zero.collect_reports()
    assert [r.rank for r in reports] == [0, 1] and reports[0].results == [_result()]
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


def _hear_in_thread(board: ReportBoard) -> tuple[threading.Thread, list[Verdict | BaseException]]:
    """Rank `board.rank`'s wait for the verdict, on a thread (as the writing thread waits)."""
    heard: list[Verdict | BaseException] = []

    def other_rank() -> None:
        try:
            heard.append(board.hear_verdict())
        except BaseException as caught:  # the test reads it
            heard.append(caught)

    thread = threading.Thread(target=other_rank)
    thread.start()
    return thread, heard


def test_a_rank_that_wrote_early_hears_a_verdict_given_after_its_own_deadline() -> None:
    """Rank 1 wrote first; rank 0's write ended later and it committed more than D after rank
    1's write ended (within D of its own): rank 1 still hears the commit, not a timeout of
    its own while `latest` moves."""
    zero, one, _ = _boards(deadline_s=0.5)
    one.post_report(RankReport(1, [], {}))
    thread, heard = _hear_in_thread(one)
    time.sleep(0.8)  # rank 0 still writes its part
    zero.post_report(RankReport(0, [], {}))
    zero.collect_reports()
    assert zero.claim_commit() is None
    assert zero.post_verdict(Verdict(None)).error is None
    thread.join(timeout=10)
    assert len(heard) == 1 and isinstance(heard[0], Verdict), heard
    assert heard[0].error is None
    assert verdict_wait_s(0.5) > 2 * 0.5


def test_a_rank_that_gives_up_decides_every_rank_s_verdict() -> None:
    """Past its wait, rank 1 gives up before rank 0 claimed the commit: rank 0 commits
    nothing and ends with rank 1's error, the same everywhere."""
    zero, one, store = _boards(deadline_s=0.1)
    one.post_report(RankReport(1, [], {}))
    thread, heard = _hear_in_thread(one)
    thread.join(timeout=10)  # verdict_wait_s(0.1): 0.3 s
    assert isinstance(heard[0], Verdict) and heard[0].error is not None, heard
    assert "rank 1 gave up waiting for rank 0's verdict" in str(heard[0].error)
    zero.post_report(RankReport(0, [], {}))
    zero.collect_reports()
    taken = zero.claim_commit()
    assert taken is not None and str(taken.error) == str(heard[0].error)
    assert str(zero.post_verdict(taken).error) == str(heard[0].error)
    assert store.num_keys() <= 1


def test_a_commit_claimed_before_the_deadline_is_waited_for() -> None:
    """Rank 0 claimed the commit before rank 1's wait ran out: rank 1 does not give up, it
    hears how the commit ended."""
    zero, one, _ = _boards(deadline_s=0.1)
    one.post_report(RankReport(1, [], {}))
    zero.post_report(RankReport(0, [], {}))
    thread, heard = _hear_in_thread(one)
    zero.collect_reports()
    assert zero.claim_commit() is None
    time.sleep(verdict_wait_s(0.1) + 0.15)  # the commit takes longer than rank 1's wait
    assert zero.post_verdict(Verdict(None)).error is None
    thread.join(timeout=10)
    assert isinstance(heard[0], Verdict) and heard[0].error is None, heard


def test_a_late_report_reads_the_verdict_given_without_it_at_once() -> None:
    """Rank 0 gave up on rank 1's report and posted its error; rank 1, reporting after that,
    reads that verdict at once (not a wait of its own while the others are in a collective),
    and the last acknowledgement removes every key, the late report's included."""
    zero, one, store = _boards(deadline_s=0.3)
    zero.post_report(RankReport(0, [], {}))
    with pytest.raises(CheckpointError, match=r"report/1") as missing:
        zero.collect_reports()
    decided = zero.post_verdict(Verdict(missing.value))  # rank 1 never read it: 0.3 s
    one.post_report(RankReport(1, [], {}))
    start = time.monotonic()
    late = one.hear_verdict()
    assert time.monotonic() - start < 0.2
    assert str(late.error) == str(decided.error) == str(missing.value)
    assert store.num_keys() <= 1


def test_reports_are_json_and_come_back_as_dcp_s_write_results() -> None:
    """A report in the store is JSON (nothing read from it is unpickled) that gives back DCP's
    write results, and the error's type."""
    zero, one, store = _boards()
    result = _result()
    entries = {"rank1.json": {"size": 3, "hash": "00ff"}}
    one.post_report(RankReport(1, [result], entries, CheckpointStorageError("disk full")))
    zero.post_report(RankReport(0, [], {}))
    raw = store.get("zerodp/decoupled_save/.tmp.t.0123456789ab/report/1")
    assert json.loads(raw)["results"][0]["fqn"] == "layer.weight"
    got = zero.collect_reports()[1]
    assert got.results == [result] and got.entries == entries
    assert isinstance(got.error, CheckpointStorageError) and str(got.error) == "disk full"
