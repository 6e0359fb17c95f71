"""The reducer's bucket pool: reuse within a size, and no idle buffer beside a new one."""

from __future__ import annotations

import torch

from zerodp.backward.buffers import BufferPool

CPU = torch.device("cpu")


def test_a_buffer_given_back_is_reused_for_its_size() -> None:
    pool = BufferPool()
    first = pool.take(8, torch.float32, CPU)
    pool.give_back(first)
    again = pool.take(8, torch.float32, CPU)
    assert again.data_ptr() == first.data_ptr()
    assert pool.allocated_numel == 8


def test_idle_buffers_of_other_sizes_go_before_a_new_one_is_made() -> None:
    """Groups of a few sizes take turns in a backward: the idle ones of the other sizes
    would otherwise sit beside every new bucket until the backward's end."""
    pool = BufferPool()
    out = pool.take(100, torch.float32, CPU)
    idle = pool.take(100, torch.float32, CPU)
    pool.give_back(idle)
    assert pool.idle_numel == 100
    small = pool.take(30, torch.float32, CPU)  # a new size: the idle 100 goes first
    assert pool.idle_numel == 0
    assert pool.held_numel == 130
    assert pool.allocated_numel == 200  # the high-water mark, before
    pool.give_back(out)
    pool.give_back(small)
    pool.release_idle()
    assert pool.held_numel == 0
