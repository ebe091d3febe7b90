"""Scattering: rows copied into the places that `tdgather.core.plan.place` gave them.

`scatter_chunks` copies a part's chunks (consecutive batches of rows) to their rows of each
leaf's buffer: a chunk whose places are one run with one plain copy, any other with one index
copy. Many small batches are joined first (`joined_chunks`), so the copies stay few. A ragged
leaf's value rows go through `ValuePlaces`: the places of a source's value rows, computed a
slice at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from .ragged import element_index, values_of
from .rows import row_view, run_start, scatter_rows

__all__ = ["ValuePlaces", "joined_chunks", "scatter_chunks"]


class ValuePlaces:
    """Where a source's value rows of one ragged leaf go in the buffer's values, a slice at a time.

    Source frame ``r`` has ``lengths[r]`` rows; they go to rows ``offsets[dest[r]]`` on. Slicing gives
    the places of value rows ``a .. b-1`` (int64): an index of every value row (8 bytes a row, twice
    a score's 4) is never held whole, only a piece's at a time.
    """

    def __init__(self, dest: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor) -> None:
        self.dest, self.lengths, self.offsets = dest, lengths, offsets
        self.ends = torch.cumsum(lengths, 0)
        self.total = int(self.ends[-1]) if lengths.numel() else 0

    def numel(self) -> int:
        """Value rows of the source."""
        return self.total

    def __getitem__(self, s: slice) -> torch.Tensor:
        a, b, _ = s.indices(self.total)
        if b <= a:
            return torch.empty(0, dtype=torch.int64)
        r0 = int(torch.searchsorted(self.ends, a, right=True))  # the frame holding row a
        r1 = int(torch.searchsorted(self.ends, b - 1, right=True)) + 1  # past the frame holding row b - 1
        first = int(self.ends[r0] - self.lengths[r0])
        places = element_index(self.offsets[self.dest[r0:r1]], self.lengths[r0:r1])
        return places[a - first : b - first]


# below this average batch size, chunks are joined and scattered together (a scatter a chunk costs
# Python calls; joining costs a copy into new memory): 64 KiB; at 1 MiB, mixed took 0.060-0.064 s
# (now 0.047-0.054) and skewed 0.16-0.24 s (now 0.14) at 2 ranks (`benchmarks.suite`); tiny, detection unchanged
_SMALL_CHUNK = 32 << 10
_JOINED = 16 << 20  # in joined chunks of about this many bytes


def _joined(chunks: list[list[torch.Tensor]], leaves: int) -> list[list[torch.Tensor]]:
    """Consecutive chunks joined into chunks of about `_JOINED` bytes (so a scatter's index stays small)."""
    out, run, size = [], [], 0
    for c in [*chunks, None]:
        if c is None or (run and size >= _JOINED):
            out.append([torch.cat([r[j] for r in run]) for j in range(leaves)])
            run, size = [], 0
        if c is not None:
            run.append(c)
            size += sum(t.numel() * t.element_size() for t in c)
    return out


def joined_chunks(chunks: list[list[torch.Tensor]], leaves: int) -> list[list[torch.Tensor]]:
    """Many small batches joined into chunks of about `_JOINED` bytes (few scatters per leaf); others as they are.

    Joined chunks are large, so joining them again gives them back as they are.
    """
    nbytes = sum(t.numel() * t.element_size() for c in chunks for t in c)
    if len(chunks) > 8 and nbytes < len(chunks) * _SMALL_CHUNK:
        return _joined(chunks, leaves)
    return chunks


def scatter_chunks(buffers: list[Any], dests: list[torch.Tensor], chunks: list[list[torch.Tensor]]) -> None:
    """Copy a part's chunks (consecutive batches of rows) to rows ``dests[j]`` of each leaf's buffer.

    A ragged leaf's buffer is a `Ragged`: its chunks' value rows go to rows ``dests[j]`` of its values.
    """
    if not chunks or not buffers:
        return
    if _one_row_each(buffers, dests, chunks):
        for j, (buf, dest) in enumerate(zip(buffers, dests, strict=True)):
            _rows_in_runs(buf, dest, [c[j] for c in chunks])
        return
    chunks = joined_chunks(chunks, len(buffers))
    runs: dict[int, list] = {}  # leaves that are not ragged share one dest: its runs are found once
    for j, (buf, dest) in enumerate(zip(buffers, dests, strict=True)):
        data = values_of(buf)
        if id(dest) not in runs:
            bounds = torch.tensor([0] + [c[j].shape[0] for c in chunks]).cumsum(0).tolist()
            runs[id(dest)] = [(dest[a:b], run_start(dest[a:b])) for a, b in zip(bounds, bounds[1:], strict=False)]
        for chunk, (d, first) in zip(chunks, runs[id(dest)], strict=True):
            if d.numel():
                scatter_rows(data, d if first is None else first, chunk[j])


def _one_row_each(buffers: list[Any], dests: list[torch.Tensor], chunks: list[list[torch.Tensor]]) -> bool:
    """Whether every chunk is one row (a dict's large frames, each its own) of plain leaves, a place each."""
    return (
        len(chunks) > 8
        and all(type(b) is torch.Tensor for b in buffers)
        and all(d.numel() == len(chunks) for d in dests)
        and all(t.shape[0] == 1 for c in chunks for t in c)
    )


def _rows_in_runs(buf: torch.Tensor, dest: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """Row ``k`` to ``buf[dest[k]]``: each run of consecutive places one `torch.cat` straight into it.

    The frames are copied once, where joining them first (`joined_chunks`) would copy them twice;
    as bytes (`row_view`), bit-exact for every dtype.
    """
    breaks = (dest[1:] != dest[:-1] + 1).nonzero().flatten().add(1).tolist()
    for a, b in zip([0, *breaks], [*breaks, len(rows)], strict=True):
        at = int(dest[a])
        if at < 0 or at + b - a > buf.shape[0]:  # a place outside the buffer: the index copy names it
            scatter_rows(buf, dest[a:b], torch.cat(rows[a:b]))
            continue
        torch.cat([row_view(r, 1) for r in rows[a:b]], out=row_view(buf[at : at + b - a], 1))  # bytes: any dtype
