"""`WriteLoop`: a writer's write thread, which merges what arrives and writes it as shards.

Each chunk that reaches the writer (a peer's, on buffers from its `tdgather.core.pool.BufferPool`,
or its own loop's) joins the spill (`tdgather.api.settings.Spill`). A full spill is planned
(`tdgather.core.merge`, rows by reference where they are large) and merged into the shard being
gathered (`tdgather.api.settings.Pending`), which is written once full, straight from those
buffers, while the previous shard is fsynced on the sink's thread; then the buffers go back to
the pool. What is held is also written at least every ``commit_every`` seconds.
"""

from __future__ import annotations

import queue
from collections.abc import Collection

from ..core.duplicates import DuplicateCounts, DuplicatePolicy
from ..core.merge import Merged, merge
from ..core.plan import Mismatches
from ..core.pool import BufferPool
from ..errors import DuplicateFrameError
from ..storage.sink import Sink
from .failure import Failure
from .jobs import Job
from .reporting import LOG_EVERY, Report
from .settings import Pending, Settings, Spill, bookkeeping_bytes

__all__ = ["WriteLoop"]


class WriteLoop:
    """Write everything that reaches ``inbox`` with ``sink``, after a failure elsewhere too, until a write fails.

    1. ``start()``: the progress report (`tdgather.api.reporting.Report`) and the thread;
    2. the thread takes ``inbox``'s items until every rank of ``sources`` has sent its
       ``("end", rank, error or None)``: ``("parts", rank, (parts, buffers))`` from a receive thread,
       ``("local", rank, store)`` from the writer's own loop;
    3. ``join()``, ``report.close()``; then ``received`` (frames per rank) and ``all_duplicates``.

    ``reporters``: sources that send no frames (the coordinator's other writers, which end with their
    report). Once only they are still open, what is held is written at once, beside their writes,
    not after the slowest of them.

    A conflict (a copy the duplicates policy refuses, a filename with two layouts) fails the run,
    but the loop goes on writing what arrives, so that what was received is saved; a failed write
    stops writing. Every failure goes to ``failure``.
    """

    def __init__(
        self,
        settings: Settings,
        sink: Sink,
        inbox: queue.Queue,
        pool: BufferPool,
        failure: Failure,
        sources: list[int],
        reporters: Collection[int] = (),
    ) -> None:
        self.settings, self.sink, self.inbox, self.pool, self.failure = settings, sink, inbox, pool, failure
        self.sources = sorted(sources)
        self.reporters = frozenset(reporters)
        self.received = dict.fromkeys(self.sources, 0)  # frames per rank
        self.received_bytes = dict.fromkeys(self.sources, 0)
        self.policy = settings.duplicates
        self.duplicates = DuplicateCounts()  # dropped within spills; the sink counts those against the disk
        self.pending = Pending()  # the shard being gathered from spills, until it is written
        self.write_failed = False
        self.report: Report | None = None
        self.thread = Job(self._run, "tdgather-write")

    @property
    def all_duplicates(self) -> DuplicateCounts:
        """Copies dropped: in the merges, and against shards already written."""
        return self.duplicates + self.sink.duplicates

    def start(self) -> None:
        """Show progress (a bar on a terminal, else lines in the log, at least every commit); start the thread."""
        self.report = Report(self.settings.progress, self._describe, min(LOG_EVERY, self.settings.commit_every))
        self.thread.start()

    def join(self) -> None:
        """Wait until every source has ended and what arrived is written."""
        self.thread.join()

    def _run(self) -> None:
        """Each spill is merged into the shard being gathered, which is written once full, when due, and at the end."""
        spill, open_sources = Spill(), set(self.sources)
        tick = min(1.0, self.settings.commit_every / 4)
        while open_sources - self.reporters:
            self.report.tick()
            try:
                kind, src, item = self.inbox.get(timeout=tick)
            except queue.Empty:  # nothing arrived: what is held is still written in time (`Settings.commit_every`)
                if spill.due(self.settings) or self.pending.due(self.settings):
                    spill = self._merge(spill, write=True)
                continue
            if kind == "end":
                self._ended(open_sources, src, item)
                continue
            if self.write_failed:
                continue  # drain
            try:
                parts, buffers = (item.parts(src), []) if kind == "local" else item
                frames = sum(p.num_frames for p in parts)
                size = sum(p.nbytes for p in parts)
                self.received[src] += frames
                self.received_bytes[src] += size
                self.report.frames(frames)
            except BaseException as e:
                self.write_failed = True
                self.failure.fail(e)
                continue
            spill.add(parts, buffers, size + bookkeeping_bytes(parts, frames), size)
            due = spill.due(self.settings) or self.pending.due(self.settings)
            if spill.full(self.settings, self.pending.nbytes) or due:
                spill = self._merge(spill, write=due)
        if spill.parts or self.pending.groups:
            self._spill(spill, write=True)
        while open_sources:  # the reporters' ends (a frame from one fails the run in its receive thread)
            kind, src, item = self.inbox.get()
            if kind == "end":
                self._ended(open_sources, src, item)

    def _ended(self, open_sources: set[int], src: int, error: BaseException | None) -> None:
        open_sources.discard(src)
        if error is not None:
            self.failure.fail(error)

    def _merge(self, spill: Spill, write: bool) -> Spill:
        """`_spill`, then its buffers go back to the pool (merged or written: they take the next chunks).

        A sink that writes shards on threads of its own (``wait_written``: `DatasetWriter` with
        ``write_threads``) is waited for first, so no buffer is reused while a shard is written from it.
        """
        self._spill(spill, write)
        wait_written = getattr(self.sink, "wait_written", None)
        if spill.buffers and wait_written is not None:
            try:
                wait_written()
            except BaseException as e:
                self.write_failed = True
                self.failure.fail(e)
        self.pool.give(spill.buffers)
        return Spill()

    def _spill(self, spill: Spill, write: bool = False) -> None:
        """Merge the spill into the shard being gathered (``self.pending``); write that shard when full, or ``write``.

        The shard's frames come first, then the spill's lowest rank first, so the copy of a
        duplicate that came first is kept. A shard that is written is merged ``by_reference``:
        large rows are written straight from the received buffers (`tdgather.core.merge.Rows`),
        small ones merged into new buffers first; a shard that gathers on is a copy, and the
        received buffers go back to the pool, less its full shards of ``max_shard_bytes``, written now.

        Of a duplicate the policy refuses, one copy is kept; of a filename sent with two layouts,
        the frames of the layout that came first (in the shard being gathered, lowest rank first
        within a spill; the one on disk, after).
        """
        if self.write_failed:
            return
        mismatches: Mismatches = {}
        try:
            write = write or self.pending.full(self.settings, spill)
            parts = [*self.pending.parts(), *sorted(spill.parts, key=lambda p: p.rank)]
            since = self.pending.since if self.pending.groups else spill.since
            try:
                merged = merge(parts, self.policy, by_reference=write, mismatches=mismatches, fixed=self.settings.fixed)
            except DuplicateFrameError as e:
                self._keep_copies(e)
                merged = merge(parts, self.policy, by_reference=write, mismatches=mismatches, fixed=self.settings.fixed)
            self.duplicates += merged.duplicates
            if write:
                self.pending = Pending()
                self._write(merged, mismatches)
            else:
                shards, self.pending = Pending.gather(merged.groups, since, self.settings)
                for groups in shards:
                    self._write(Merged(groups), mismatches)
        except BaseException as e:
            self.write_failed = True
            self.failure.fail(e)
        for _, error in mismatches.values():
            self.failure.fail(error)

    def _write(self, merged: Merged, mismatches: Mismatches) -> None:
        """Write merged frames as shards; a copy on disk that the policy refuses fails the run, and they are written."""
        try:
            self.sink.write(merged, None, mismatches)
        except DuplicateFrameError as e:  # raised before anything is written
            self._keep_copies(e)
            self.sink.write(merged, None, mismatches)

    def _keep_copies(self, e: DuplicateFrameError) -> None:
        """A copy the policy refuses: the run fails, and from now on one copy of each frame is kept."""
        self.failure.fail(e)
        self.policy = DuplicatePolicy("keep")
        self.sink.set_policy(self.policy)

    def _describe(self) -> str:
        """The progress text after the frame count: bytes, shards written, per rank (up to 8 ranks)."""
        ranks = self.received_bytes.items()
        per_rank = " ".join(f"r{r}:{self.received[r]}/{b / 1e6:.0f}MB" for r, b in ranks) if len(ranks) <= 8 else ""
        total = sum(self.received_bytes.values()) / 1e6
        return f"{total:.0f} MB, {len(self.sink.shards)} shards {per_rank}".rstrip()
