"""The Collector's receive buffers: reused while within the cap, dropped past it."""

import torch

from tdgather.core.pool import BufferPool


def test_buffers_given_back_are_reused_and_the_cap_drops_the_rest():
    pool = BufferPool(cap=8 << 20)
    a = pool.take(3 << 20)
    assert a.dtype == torch.uint8 and a.numel() >= 3 << 20 and pool.held == a.numel()
    pool.give([a])
    b = pool.take((3 << 20) - 5)  # about the same size: the same buffer
    assert b.data_ptr() == a.data_ptr() and pool.reused == 1
    c = pool.take(1 << 20)  # much smaller than anything kept: a new one
    assert c.data_ptr() != b.data_ptr() and pool.held == (4 << 20)
    big = pool.take(6 << 20)  # held 10 MiB now, over the cap
    pool.give([b, c, big])
    assert pool.held <= pool.cap  # the largest kept buffers went back to the system first
    assert pool.take(6 << 20).data_ptr() != big.data_ptr()


def test_small_buffers_are_not_pooled():
    pool = BufferPool(cap=1 << 30)
    small = pool.take(1000)
    assert small.numel() == 1000 and pool.held == 0
    pool.give([small])
    assert pool.held == 0 and pool.take(1000).numel() == 1000
