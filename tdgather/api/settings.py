"""What a `tdgather.Collector` is fixed to when it opens, what it reports, and how rank dst counts its budget.

`Settings` is all that the senders and rank dst read (`tdgather.api.streams`); `CollectorStatus`
and `CollectorSummary` are what a Collector reports; `Spill` is what rank dst holds until it
writes, and when it writes: at its share of the budget (frames and their bookkeeping,
`bookkeeping_bytes`), or once it holds `SPILL_FRAME_BYTES` of frames.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..core.duplicates import DuplicateCounts, DuplicatePolicy
from ..storage.location import is_url
from ..storage.objects import BLOCK_BYTES, PARTS_IN_FLIGHT
from ..storage.sink import SinkFactory

__all__ = ["SPILL_FRAME_BYTES", "CollectorStatus", "CollectorSummary", "Settings", "Spill", "bookkeeping_bytes"]

# What merging a buffer costs per frame beyond its bytes (sort keys, permutations, masks, int64
# indices): about 100 bytes. Counted against the budget, so that tiny frames respect it too.
_MERGE_BYTES_PER_FRAME = 128
_MERGE_BYTES_PER_VALUE_ROW = 24  # a ragged leaf's value row: its int64 place, source chunk and row
# What writing a spill costs per filename beyond its frames: its name in the merge's tables, its
# views and segment while its shard is written (about 1.5 KB, measured with 300,000 one-frame
# filenames). Counted, so that a spill of many small files stays within the budget too.
_WRITE_BYTES_PER_FILE = 1536
# rank dst writes what it holds once it holds this many frame bytes, even under its budget: the
# writes overlap receiving (a spill of many small files is not cut: its cost grows with the files)
SPILL_FRAME_BYTES = 64 << 20


@dataclass(frozen=True)
class Settings:
    """A Collector's settings, fixed when it opens: all that `Sender` and `Destination` read.

    The budget on rank dst, in chunks c: one payload per receiver (``peers``) + the inbox
    (``max_pending``) + the spill (``spill_bytes`` + c) + a merge's copy of small rows (spill + c).
    With the default c = budget / (8 (W + 1)) that is at most budget / 4 + 0.7 budget.
    """

    path: Path | str  # a local path, or an object store URL
    dst: int
    timeout: timedelta
    overwrite: bool
    duplicates: DuplicatePolicy
    copy: bool
    memory_budget: int
    chunk_bytes: int
    max_pending: int
    max_shard_bytes: int
    progress: bool | None
    metadata: Mapping[str, Any]
    peers: int  # ranks that send to dst
    resume: bool = False
    sink: SinkFactory | None = None  # makes rank dst's (and each writer's) sink; default DatasetWriter
    storage_options: dict | None = None  # fsspec's, for an object store URL
    fixed: bool = False  # ragged=False: every leaf fixed, a first dim that changes refused (else made ragged)

    @property
    def upload_bytes(self) -> int:
        """What an object store upload holds (its parts in flight, and the one being cut); 0 for a local path."""
        return (PARTS_IN_FLIGHT + 1) * BLOCK_BYTES if is_url(self.path) else 0

    @property
    def spill_bytes(self) -> int:
        """Bytes rank dst buffers before it writes them."""
        return max(self.chunk_bytes, (self.memory_budget - self.upload_bytes) * 35 // 100)

    @property
    def pool_bytes(self) -> int:
        """Received buffers kept for reuse: at most the spill and every chunk in flight."""
        return self.spill_bytes + (self.max_pending + self.peers) * self.chunk_bytes


@dataclass(frozen=True)
class CollectorStatus:
    """A snapshot of an open `Collector`, on any rank (`Collector.status`).

    Attributes:
        frames_received: on rank dst (or a block's writer), the frames received so far from each
            rank (its own included); elsewhere empty.
        shards: shards written so far (rank dst, a writer); else 0.
        pending_peak: on a sender, the most chunks it has held unsent at once (at most
            ``max_pending``: back-pressure); else 0.
    """

    frames_received: dict[int, int] = field(default_factory=dict)
    shards: int = 0
    pending_peak: int = 0


@dataclass(frozen=True)
class CollectorSummary:
    """What a `Collector` wrote, returned by ``close()`` on rank ``dst``."""

    path: str
    frames: int
    bytes: int
    duplicates_dropped: int
    frames_per_rank: dict[int, int] = field(default_factory=dict)
    shards: int = 0
    seconds: float = 0.0
    close_seconds: float = 0.0
    duplicates: DuplicateCounts = field(default_factory=DuplicateCounts)
    combine_seconds: float = 0.0  # with several writers: reading their shards' records, copies across them
    shared_chunks: int = 0  # chunks received through shared memory (senders on rank dst's host), not gloo

    @property
    def throughput_mb_s(self) -> float:
        """Frame bytes written per second, from ``open()`` to the end of ``close()``."""
        return self.bytes / 1e6 / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        per_rank = ", ".join(f"{r}: {n}" for r, n in self.frames_per_rank.items())
        d = self.duplicates
        dups = f"{d.dropped} duplicates dropped ({d.exact} exact, {d.inexact} inexact, max diff {d.max_abs_diff:g})"
        return (
            f"tdgather: {self.frames} frames, {self.bytes / 1e6:.1f} MB, {dups}, "
            f"per rank {{{per_rank}}}, {self.shards} shards in {self.path}, {self.seconds:.2f} s "
            f"({self.throughput_mb_s:.1f} MB/s), close {self.close_seconds:.3f} s"
            + (f", {self.shared_chunks} chunks through shared memory" if self.shared_chunks else "")
        )


class Spill:
    """What rank dst's writer holds until it writes: parts, the pooled buffers under them, budget bytes, frame bytes."""

    def __init__(self) -> None:
        self.parts: list = []
        self.buffers: list = []
        self.nbytes = 0
        self.frame_bytes = 0

    def add(self, parts: list, buffers: list, nbytes: int, frame_bytes: int) -> None:
        """Hold ``parts`` (on ``buffers``): ``nbytes`` of the budget, ``frame_bytes`` of frames."""
        self.parts += parts
        self.buffers += buffers
        self.nbytes += nbytes
        self.frame_bytes += frame_bytes

    def full(self, settings: Settings) -> bool:
        """Time to write: the budget's share reached, or `SPILL_FRAME_BYTES` of frames held."""
        return self.nbytes >= settings.spill_bytes or self.frame_bytes >= SPILL_FRAME_BYTES


def bookkeeping_bytes(parts: list, frames: int) -> int:
    """What merging and writing ``parts`` costs beyond their tensor bytes: per frame, value row and filename."""
    values = sum(p.value_rows for p in parts)
    files = sum(len(p.files) for p in parts)
    return _MERGE_BYTES_PER_FRAME * frames + _MERGE_BYTES_PER_VALUE_ROW * values + _WRITE_BYTES_PER_FILE * files
