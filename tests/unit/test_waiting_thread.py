"""The helper thread that waits for reduce-scatters: a small stack, and the setting restored."""

from __future__ import annotations

import threading

from zerodp.comm.faults import polled_waits


class _DoneWork:
    def wait(self) -> bool:
        return True


def test_the_helper_starts_with_a_small_stack_and_leaves_the_default_alone() -> None:
    before = threading.stack_size()
    watched = polled_waits.watch(_DoneWork())
    assert watched.wait(lambda: None) is False
    assert threading.stack_size() == before  # threads started later get the usual stack
    assert polled_waits.stop_waiting_thread(5.0)
