"""Rows written into rank dst's result files with ``pwritev``: a run of consecutive places a call.

A same-host sender (and rank dst, for its own rows) puts its frames into rank dst's result, a
row of memfds (`tdgather.comm.regions`). Copying them through a mapping faults every page into
the copying process (a page-table entry a 4 KiB page, in every process, contending on the files);
``pwritev`` copies the bytes into the files' pages in the kernel, with no mapping and no fault.
Each run of rows whose places are consecutive is one ``iovec``; runs that land one after the
other in one file go in one call. Each writer starts at its own point of its runs (``first``), so
that writers are in different files, each under its own lock, at once.

Only worth it for large runs: every run costs a Python step and an ``iovec``, where one index copy
into a mapping places any number of small rows (`PWRITE_RUN`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PWRITE_RUN", "Files", "write_leaves", "write_rows"]

# below this average run of rows, one index copy into a mapping is faster than a pwritev a run
# (4 processes on 2 cores writing 40 MB each at every 4th place: 1 KiB rows 0.17-0.21 s mapped
# against 0.19-0.21 s written; 16 KiB rows 0.08-0.09 s against 0.06-0.08 s)
PWRITE_RUN = 16 << 10
_IOV_MAX = 1024


@dataclass(frozen=True)
class Files:
    """Where rows are written: ``fds``, ``region`` bytes each, one after the other (byte b in file b // region)."""

    fds: list[int]
    region: int

    def pieces(self, off: int, n: int) -> Iterator[tuple[int, int, int]]:
        """Bytes ``off .. off + n`` as ``(file number, offset in it, bytes)``, split where a file ends."""
        while n > 0:
            f, within = divmod(off, self.region)
            k = min(n, self.region - within)
            yield f, within, k
            off, n = off + k, n - k

    def read(self, off: int, n: int) -> bytearray:
        """Bytes ``off .. off + n``; `OSError` on a short read."""
        out = bytearray(n)
        got = 0
        for f, within, k in self.pieces(off, n):
            if os.preadv(self.fds[f], [memoryview(out)[got : got + k]], within) != k:
                raise OSError(f"a short read of {k} bytes at byte {within} of file {f}")
            got += k
        return out


def _breaks(dest: torch.Tensor, sizes: list[int]) -> list[int]:
    """Where a new run starts: a place that does not follow the previous one, or a new chunk."""
    cut = torch.zeros(dest.numel(), dtype=torch.bool)
    if dest.numel():
        cut[0] = True
        cut[1:] = dest[1:] != dest[:-1] + 1
        starts = torch.tensor([0, *sizes[:-1]]).cumsum(0)
        cut[starts[starts < dest.numel()]] = True
    return cut.nonzero().flatten().tolist()


def write_leaves(
    files: Files,
    starts: list[int | None],
    row_nbytes: list[int],
    dests: list[Any],
    chunks: list[list[torch.Tensor]],
    first: float = 0.0,
) -> list[int]:
    """Write the leaves whose rows go in runs of `PWRITE_RUN` bytes or more on average; the others, left.

    Leaf ``j``'s buffer starts at byte ``starts[j]`` of ``files`` (None: not there); ``dests[j]``
    is its rows' places (a tensor; anything else, a ragged leaf's, is left); ``first``, as
    `write_rows`.
    """
    sizes = [c[0].shape[0] if c else 0 for c in chunks]
    breaks: dict[int, list[int]] = {}
    rest = []
    for j, (start, nbytes, dest) in enumerate(zip(starts, row_nbytes, dests, strict=True)):
        if start is None or type(dest) is not torch.Tensor:
            rest.append(j)
            continue
        if id(dest) not in breaks:
            breaks[id(dest)] = _breaks(dest, sizes)
        runs = len(breaks[id(dest)])
        if runs and dest.numel() * nbytes >= runs * PWRITE_RUN:
            write_rows(files, start, nbytes, dest, [c[j] for c in chunks], breaks[id(dest)], first)
        elif dest.numel():
            rest.append(j)
    return rest


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write_rows(
    files: Files,
    base: int,
    row_nbytes: int,
    dest: torch.Tensor,
    chunks: list[torch.Tensor],
    breaks: list[int] | None = None,
    first: float = 0.0,
) -> None:
    """Write row ``r`` of ``chunks`` (in order) at byte ``base + dest[r] * row_nbytes`` of ``files``.

    The runs are written from the one at fraction ``first`` of them on, then from the start.
    ``dest`` must already be checked to lie within the files (the caller's bounds): a write past a
    sealed memfd's size fails with an `OSError` rather than growing it.
    """
    sizes = [c.shape[0] for c in chunks]
    starts = _breaks(dest, sizes) if breaks is None else breaks
    places = dest[starts].tolist() if starts else []
    views = [_bytes(c) for c in chunks]
    runs = []
    c, c0 = 0, 0  # the chunk holding the run, and its first row's number
    for a, b, p in zip(starts, [*starts[1:], dest.numel()], places, strict=True):
        while a >= c0 + sizes[c]:
            c0 += sizes[c]
            c += 1
        runs.append((base + p * row_nbytes, views[c][(a - c0) * row_nbytes : (b - c0) * row_nbytes]))
    k = min(len(runs), max(0, int(len(runs) * first)))
    _write_runs(files, runs[k:] + runs[:k])


def _write_runs(files: Files, runs: list[tuple[int, memoryview]]) -> None:
    """Each (byte, bytes) written, split where it crosses into the next file; neighbours in one call."""
    batch: list[memoryview] = []
    fd = at = nxt = -1
    for off, view in runs:
        done = 0
        for f, within, n in files.pieces(off, len(view)):
            if batch and (files.fds[f] != fd or within != nxt or len(batch) >= _IOV_MAX):
                _pwritev(fd, batch, at)
                batch = []
            if not batch:
                fd, at = files.fds[f], within
            batch.append(view[done : done + n])
            nxt, done = within + n, done + n
    if batch:
        _pwritev(fd, batch, at)


def _pwritev(fd: int, views: list[memoryview], at: int) -> None:
    """``os.pwritev`` until every byte is written (a short write resumes inside its buffer)."""
    k = 0
    while k < len(views):
        n = os.pwritev(fd, views[k:], at)
        if n <= 0:
            raise OSError(f"pwritev wrote nothing at offset {at}")
        at += n
        while k < len(views) and n >= len(views[k]):
            n -= len(views[k])
            k += 1
        if n:
            views[k] = views[k][n:]
