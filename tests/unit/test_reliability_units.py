"""Small pure pieces of the reliability work: config keys, the timeout's sources, leftovers,
which collective failures are named."""

from __future__ import annotations

import datetime

import pytest
import torch

import zerodp
from zerodp.checkpoint_io import paths
from zerodp.comm import Handle
from zerodp.comm.faults import failure_notices
from zerodp.comm.faults.collective_history import CollectiveHistory, CollectiveRecord, recorded
from zerodp.comm.process_group import comms_timeout
from zerodp.config import load_config
from zerodp.errors import CollectiveError
from zerodp.torch_internals import forward_raised


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


class _FakeComm:
    """Just what `recorded` reads: a world size above one and a history."""

    world_size = 2

    def __init__(self, error: RuntimeError) -> None:
        self.history = CollectiveHistory(rank=0)
        self.error = error

    @recorded("all_gather")
    def all_gather(self, output: torch.Tensor) -> None:
        raise self.error


class _FailingWork:
    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def wait(self) -> None:
        raise self.error


def test_running_out_of_memory_in_a_collective_is_not_blamed_on_a_peer() -> None:
    """An allocation failure inside a collective (gloo's own buffers, a CUDA OOM) stays the
    allocator's error; a backend failure about the peers becomes the named CollectiveError."""
    out_of_memory = [
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"
        ),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ]
    for error in out_of_memory:
        with pytest.raises(type(error)) as caught:
            _FakeComm(error).all_gather(torch.empty(4))
        assert not isinstance(caught.value, CollectiveError)
        handle = Handle(_FailingWork(error))
        handle.track(*_tracked())
        with pytest.raises(type(error)) as caught:
            handle.wait()
        assert not isinstance(caught.value, CollectiveError)
    peer = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    with pytest.raises(CollectiveError, match="all_gather #1"):
        _FakeComm(peer).all_gather(torch.empty(4))
    handle = Handle(_FailingWork(peer))
    handle.track(*_tracked())
    with pytest.raises(CollectiveError, match="reduce_scatter #1"):
        handle.wait()


def _tracked() -> tuple[CollectiveRecord, CollectiveHistory]:
    history = CollectiveHistory(rank=0)
    return history.issue("reduce_scatter", 64), history


def test_after_a_failed_collective_the_group_is_aborted_and_nothing_more_is_issued() -> None:
    """The first failure aborts the process group once (its other in-flight collectives
    fail at once, none is left pending at exit); a later collective is refused, naming the
    one that failed, without reaching the backend."""
    aborted: list[bool] = []
    comm = _FakeComm(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    comm.history.on_failure = lambda: aborted.append(True)
    with pytest.raises(CollectiveError, match="all_gather #1"):
        comm.all_gather(torch.empty(4))
    assert aborted == [True]
    comm.error = AssertionError("the backend must not be reached again")  # type: ignore[assignment]
    with pytest.raises(CollectiveError, match=r"not issued: collective all_gather #1 .*failed"):
        comm.all_gather(torch.empty(4))
    assert aborted == [True]
    assert comm.history.count == 1


class _Probe(torch.nn.Module):
    """Records, in an always-called forward hook, what `forward_raised` said."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.seen: list[BaseException | None] = []
        self.register_forward_hook(
            lambda module, args, output: self.seen.append(forward_raised()), always_call=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise torch.OutOfMemoryError("no room")
        return x + 1


def test_a_hook_tells_a_dying_forward_from_a_forward_run_inside_an_except_block() -> None:
    dying = _Probe(fail=True)
    with pytest.raises(torch.OutOfMemoryError):
        dying(torch.ones(1))
    assert isinstance(dying.seen[-1], torch.OutOfMemoryError)
    fine = _Probe(fail=False)
    fine(torch.ones(1))
    try:  # a retry after an error: the error being handled is not the forward's
        raise ValueError("first attempt failed")
    except ValueError:
        fine(torch.ones(1))
    assert fine.seen == [None, None]
    outer = torch.nn.Sequential(_Probe(fail=False), _Probe(fail=True))
    with pytest.raises(torch.OutOfMemoryError):
        outer(torch.ones(1))
    assert outer[0].seen == [None] and isinstance(outer[1].seen[-1], torch.OutOfMemoryError)


def test_a_failure_notice_round_trips_and_says_where() -> None:
    notice = failure_notices.FailureNotice(
        1, "forward", 2, failure_notices.describe_error(MemoryError("x\ny"))
    )
    again = failure_notices.FailureNotice.decode(1, notice.encode())
    assert again == notice and again.error == "MemoryError: x"
    assert again.describe() == "rank 1 failed in its forward pass 3: MemoryError: x"
    ending = failure_notices.FailureNotice(0, failure_notices.EXIT, -1, "ValueError: bad record")
    assert ending.describe() == "rank 0 failed and is ending: ValueError: bad record"
    long = failure_notices.describe_error(RuntimeError("z" * 2000))
    assert len(long) < 600 and long.endswith(" ...")
