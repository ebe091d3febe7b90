"""What a `tdgather.Collector` is fixed to when it opens, what it reports, and how rank dst counts its budget.

`Settings` is what every rank's components read (`tdgather.api.choreography`), the same on every rank;
`CollectorStatus` and `CollectorSummary` are what a Collector reports; `Spill` is what rank dst
holds until it merges it, and when: at its share of the budget (frames and their bookkeeping,
`bookkeeping_bytes`), or once it holds `SPILL_FRAME_BYTES` of frames; `Pending` is the shard each
spill is merged into, compact, until it is written: at three quarters of that share, or
`SPILL_FRAME_BYTES`, or a shard of ``max_shard_bytes`` at a time. So shards grow with bytes, not
with chunks, however small the budget.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..core.duplicates import DuplicateCounts, DuplicatePolicy
from ..core.merge import as_parts, cut_groups, group_bytes
from ..core.ragged import Ragged
from ..storage.location import is_url
from ..storage.objects import BLOCK_BYTES, PARTS_IN_FLIGHT
from ..storage.sink import SinkFactory

__all__ = [
    "SPILL_FRAME_BYTES",
    "WRITE_FILES_BYTES",
    "CollectorStatus",
    "CollectorSummary",
    "Pending",
    "Settings",
    "Spill",
    "bookkeeping_bytes",
    "default_write_threads",
]

# What merging a buffer costs per frame beyond its bytes (sort keys, permutations, masks, int64
# indices): about 100 bytes. Counted against the budget, so that tiny frames respect it too.
_MERGE_BYTES_PER_FRAME = 128
_MERGE_BYTES_PER_VALUE_ROW = 24  # a ragged leaf's value row: its int64 place, source chunk and row
# What a filename costs in a spill, per chunk that holds it: its name in the chunk's header and
# part, the merge's tables, and writing it if the spill fills the shard (`_WRITE_BYTES_PER_FILE`).
# Counted, so that a spill of many small files stays within the budget too.
_SPILL_BYTES_PER_FILE = 1536
# What a frame of the shard being gathered (`Pending`) holds beside its bytes: its frame_idx (int64)
# and sender (int32), and what merging it again with the next spill costs (its rows sorted and
# distinct: about 40 bytes a frame beyond their copy, measured). A filename there: its name, count, start.
_HELD_BYTES_PER_FRAME = 64
_HELD_BYTES_PER_FILE = 128
# What writing a shard costs per filename beyond its frames: its name in the writer's tables, its
# views and segment while the shard is written (about 1.5 KB, measured with 300,000 one-frame
# filenames; 0.7 KB for a filename written before). A shard is written before its filenames cost
# more than the spill's share of the budget, or `WRITE_FILES_BYTES` where that is more (a budget
# under 12 MiB: then up to that comes on top), so that many small files stay within it too.
_WRITE_BYTES_PER_FILE = 1536
WRITE_FILES_BYTES = 4 << 20
# rank dst writes what it holds once it holds this many frame bytes, even under its budget: the
# writes overlap receiving (a spill of many small files is not cut: its cost grows with the files)
SPILL_FRAME_BYTES = 64 << 20


@dataclass(frozen=True)
class Settings:
    """A Collector's settings, fixed when it opens, the same on every rank; where a rank sends is its `Role`.

    The budget on a writer, in chunks c: one payload per receive thread (``peers``) + the inbox
    (``max_pending``) + the spill and the shard it is merged into (``spill_bytes`` + c) + a merge's
    copy of small rows (spill + c). With the default c = budget / (8 (W + 1)) that is at most
    budget / 4 + 0.7 budget. Under a budget below 12 MiB, writing a shard's filenames may come on
    top, up to `WRITE_FILES_BYTES`.
    """

    path: Path | str  # a local path, or an object store URL
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
    resume: bool = False
    sink: SinkFactory | None = None  # makes rank dst's (and each writer's) sink; default DatasetWriter
    storage_options: dict | None = None  # fsspec's, for an object store URL
    fixed: bool = False  # ragged=False: every leaf fixed, a first dim that changes refused (else made ragged)
    commit_every: float = 300.0  # seconds: rank dst writes what it holds at least this often
    append: bool = False  # the job's frames added to the dataset as its next snapshot (`tdgather.storage.append`)
    write_threads: int = 1  # shards a writer writes at once (`tdgather.storage.writer.DatasetWriter`)

    @property
    def flush_every(self) -> float:
        """Seconds a sender holds a frame at most before it sends its chunk: a quarter of ``commit_every``, <= 30."""
        return min(self.commit_every / 4, 30.0)

    @property
    def upload_bytes(self) -> int:
        """What object store uploads hold (each its parts in flight, and the one being cut); 0 for a local path."""
        return (PARTS_IN_FLIGHT + 1) * BLOCK_BYTES * self.write_threads if is_url(self.path) else 0

    @property
    def spill_bytes(self) -> int:
        """Bytes rank dst buffers before it writes them: shards being written hold theirs too, so a share of each."""
        return max(self.chunk_bytes, (self.memory_budget - self.upload_bytes) * 35 // 100 // self.write_threads)

    @property
    def write_files_bytes(self) -> int:
        """What writing a shard's filenames may cost: the spill's share, or `WRITE_FILES_BYTES` where that is more."""
        return max(self.spill_bytes, WRITE_FILES_BYTES)

    def pool_bytes(self, peers: int) -> int:
        """What a writer with ``peers`` peers keeps of received buffers: at most the spill and every chunk in flight."""
        return self.spill_bytes + (self.max_pending + peers) * self.chunk_bytes


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
    warnings: tuple[str, ...] = ()  # what the run should not have done (ranks whose shares overlapped), also logged
    snapshot: int | None = None  # append=True: the snapshot this job's commit wrote (`tdgather.snapshots` lists them)

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
            + (f", committed as snapshot {self.snapshot}" if self.snapshot is not None else "")
            + "".join(f"\nWARNING: {w}" for w in self.warnings)
        )


class Spill:
    """What rank dst's writer holds until it writes: parts, the pooled buffers under them, budget bytes, frame bytes."""

    def __init__(self) -> None:
        self.parts: list = []
        self.buffers: list = []
        self.nbytes = 0
        self.frame_bytes = 0
        self.frames = self.files = self.value_rows = 0  # its parts' (a filename counted once a part)
        self.since = time.monotonic()  # when its first part came

    def add(self, parts: list, buffers: list, nbytes: int, frame_bytes: int) -> None:
        """Hold ``parts`` (on ``buffers``): ``nbytes`` of the budget, ``frame_bytes`` of frames."""
        if not self.parts:
            self.since = time.monotonic()
        self.parts += parts
        self.buffers += buffers
        self.nbytes += nbytes
        self.frame_bytes += frame_bytes
        self.frames += sum(p.num_frames for p in parts)
        self.files += sum(len(p.names) for p in parts)
        self.value_rows += sum(p.value_rows for p in parts)

    def full(self, settings: Settings, held: int = 0) -> bool:
        """Time to merge: with ``held`` (the shard gathered) the budget's share, or `SPILL_FRAME_BYTES` of frames."""
        return self.nbytes + held >= settings.spill_bytes or self.frame_bytes >= SPILL_FRAME_BYTES

    def due(self, settings: Settings) -> bool:
        """Time to write what it holds, however little: its first part came ``commit_every`` seconds ago."""
        return bool(self.parts) and time.monotonic() - self.since >= settings.commit_every


class Pending:
    """The shard rank dst gathers until it writes it: the spills merged so far, copied out of the received buffers.

    A spill merged into it is not a shard of its own: under a small budget, or with many filenames a
    chunk, a shard still holds three quarters of the spill's share (or ``max_shard_bytes``, or
    `SPILL_FRAME_BYTES`) of compact frames, and a filename has a segment per shard, not per spill.
    ``since``: when its first frames came (it is written within ``commit_every`` of it).
    """

    def __init__(self, groups: list | None = None, since: float | None = None) -> None:
        self.groups = [g for g in groups or [] if g.num_frames]
        self.frames = sum(g.num_frames for g in self.groups)
        self.frame_bytes = sum(group_bytes(g) for g in self.groups)
        self.files = sum(len(g.files) for g in self.groups)
        values = sum(c.num_rows for g in self.groups for c in g.leaves if isinstance(c, Ragged))
        self.nbytes = _held_bytes(self.frame_bytes, self.frames, values, self.files) if self.groups else 0
        self.since = time.monotonic() if since is None else since

    def parts(self) -> list:
        """Its frames as parts (`tdgather.core.merge.as_parts`), merged before the next spill's: its copies stay."""
        return as_parts(self.groups)

    def due(self, settings: Settings) -> bool:
        """Time to write it, however little it holds: its first frames came ``commit_every`` seconds ago."""
        return bool(self.groups) and time.monotonic() - self.since >= settings.commit_every

    @staticmethod
    def gather(groups: list, since: float, settings: Settings) -> tuple[list[list], Pending]:
        """Merged ``groups`` as the shard being gathered, and the full shards cut off it, to write now.

        Each of those holds up to ``max_shard_bytes`` (cut at a filename, `tdgather.core.merge.cut_groups`);
        what is left is written whole once writing its filenames costs ``Settings.write_files_bytes``.
        """
        shards, pending = [], Pending(groups, since)
        while pending.frame_bytes + 8 * pending.frames > settings.max_shard_bytes:  # as the writer counts
            head, rest = cut_groups(pending.groups, settings.max_shard_bytes)
            shards.append(head)
            pending = Pending(rest, since)
        if _WRITE_BYTES_PER_FILE * pending.files >= settings.write_files_bytes:
            shards.append(pending.groups)
            pending = Pending()
        return shards, pending

    def full(self, settings: Settings, spill: Spill) -> bool:
        """Whether it is written whole once ``spill`` is merged in (else it gathers the next spill).

        At three quarters of the spill's share (what it holds; the spill gets the rest), or at
        `SPILL_FRAME_BYTES` of frames. Counted before the merge, with every copy and each filename
        of each part: at most what the merge gives. If so, it is merged with the spill
        ``by_reference`` and written; else its filenames are counted after the merge (`gather`).
        """
        held = self.nbytes + _held_bytes(spill.frame_bytes, spill.frames, spill.value_rows, spill.files)
        return held >= settings.spill_bytes * 3 // 4 or self.frame_bytes + spill.frame_bytes >= SPILL_FRAME_BYTES


def _held_bytes(frame_bytes: int, frames: int, value_rows: int, files: int) -> int:
    """What the shard being gathered holds for these frames: their bytes, frame_idx, sender, merging them again."""
    return (
        frame_bytes
        + _HELD_BYTES_PER_FRAME * frames
        + _MERGE_BYTES_PER_VALUE_ROW * value_rows
        + _HELD_BYTES_PER_FILE * files
    )


def bookkeeping_bytes(parts: list, frames: int) -> int:
    """What merging ``parts`` costs beyond their tensor bytes: per frame, value row, and filename of each part."""
    values = sum(p.value_rows for p in parts)
    files = sum(len(p.files) for p in parts)
    return _MERGE_BYTES_PER_FRAME * frames + _MERGE_BYTES_PER_VALUE_ROW * values + _SPILL_BYTES_PER_FILE * files


def default_write_threads(path: Path | str) -> int:
    """Shards a writer writes at once by default: a quarter of this process's cores, from 1 to 4; 1 for a URL.

    Each is written on a thread of its own; on a machine of few cores the one thread is best, as
    the senders' copies want the rest.
    """
    if is_url(path):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores // 4))
