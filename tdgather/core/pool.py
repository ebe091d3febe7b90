"""Rank dst's receive buffers, reused from chunk to chunk.

Memory the process has never touched costs a page fault per page on first write; on the VMs we
measure on that is slower than the wire itself. A `tdgather.Collector` receives chunk after chunk
of about the same size, so rank dst takes each receive buffer from this pool and gives it back
once its rows are written: after the first few chunks, payloads land in memory already touched.

The pool keeps a returned buffer only while the bytes it holds (taken and kept) stay within its
cap; past that a buffer is dropped and its memory goes back to the system.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["BufferPool"]

_SMALL = 256 << 10  # smaller buffers come from the allocator's heap, cheap already: not pooled
_ROUND = 1 << 20


class BufferPool:
    """uint8 buffers of at least the size asked, reused once given back.

    Args:
        cap: the most bytes the pool holds, taken and kept together, before it drops returned buffers.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held = 0  # bytes of pooled buffers alive: taken or kept
        self.reused = 0  # takes served by a kept buffer (for tests and figures)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int, into: list | None = None) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` (its first ``nbytes`` are the caller's); appended to ``into`` too."""
        if nbytes < _SMALL:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        else:
            with self._lock:
                fits = [k for k, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes]
                if fits:
                    self.reused += 1
                    buffer = self._free.pop(min(fits, key=lambda k: self._free[k].numel()))
                else:
                    size = -(-nbytes // _ROUND) * _ROUND
                    self.held += size
                    buffer = torch.empty(size, dtype=torch.uint8)
        if into is not None:
            into.append(buffer)
        return buffer

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Return buffers from `take`, whose contents are no longer needed."""
        with self._lock:
            self._free += [b for b in buffers if b.numel() >= _SMALL]
            self._free.sort(key=torch.Tensor.numel)
            while self.held > self.cap and self._free:  # over the cap: drop the largest kept first
                self.held -= self._free.pop().numel()
