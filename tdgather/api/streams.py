"""The two sides of a `tdgather.Collector`: the senders' pipeline and rank dst's receive-and-write.

`Sender` (every rank but dst) keeps the current chunk, a bounded queue of chunks to send, a
thread that packs and sends them (with heartbeats when idle), and a thread that waits for rank
dst's answer. `Destination` (rank dst) receives each peer on its own thread, into buffers
reused from a `tdgather.core.pool.BufferPool`, and queues the chunks in a bounded inbox; a writer
thread plans each spill (`tdgather.core.merge`, rows by reference where they are large) and writes
its rows in order straight from those buffers, while the previous shard is fsynced on the
sink's thread; then the buffers go back to the pool. The call order is in `tdgather.api.collector`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..comm.pack import pack
from ..comm.protocol import Joiner, end_stream, expect_done, read_frames, send_frames
from ..comm.shm import PeerSegments, SegmentWriter, host_token, sweep
from ..comm.transport import Answers, Call, heartbeat_interval, peer_error
from ..comm.wire import HEARTBEAT, Kind, error_header
from ..core.duplicates import DuplicateCounts, DuplicatePolicy, overlap_warning
from ..core.merge import Merged, merge
from ..core.metadata import USER_KEY, user_metadata
from ..core.plan import Mismatches
from ..core.pool import BufferPool
from ..core.store import FrameStore
from ..errors import DuplicateFrameError, PeerError, PeerLostError, ProtocolError, StalledError
from ..format.parts import check_part, check_run, counts_of
from ..storage.recovery import Saved
from ..storage.writer import DatasetWriter
from .jobs import Job
from .liveness import Progress
from .reporting import LOG_EVERY, Report
from .settings import CollectorStatus, CollectorSummary, Pending, Settings, Spill, bookkeeping_bytes

__all__ = ["BlockWriter", "Coordinator", "Destination", "Sender", "Uplink"]

log = logging.getLogger("tdgather")

_POLL = 0.1  # seconds between the send thread's looks at dst's answer while idle
_AFTER_ANSWER = 5.0  # seconds a sender still waits for its sends once dst has answered
_CLOSE = object()
_CHUNK_BYTES_PER_FILE = 512  # a filename in a chunk: in the store, the wire header, rank dst's parsed copy


def _return_freed_memory() -> None:
    """On glibc, fix the mmap threshold so that freed chunk buffers go back to the OS at once.

    glibc raises its threshold after large frees and then keeps such buffers on its heaps, so
    resident memory drifts above what is alive. Fixing it (mallopt M_MMAP_THRESHOLD) stops that.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 256 << 10)  # M_MMAP_THRESHOLD = 256 KiB
    except (OSError, AttributeError):
        pass


class _Side:
    """What senders and rank dst share: the current chunk, back-pressure, the first failure."""

    def __init__(
        self, chunk_bytes: int, max_pending: int, copy: bool, fixed: bool = False, flush_every: float = 0
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.flush_every = flush_every or float("inf")  # seconds a chunk's first frame may wait
        self.chunk_since: float | None = None
        self.copy, self.fixed = copy, fixed
        self.saved = Saved()  # what a resumed run saved already (empty for a fresh one)
        self.store = FrameStore(copy, fixed=fixed)
        self.queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.failure: BaseException | None = None
        self.lock = threading.Lock()
        self.progress = Progress()  # the loop's calls into tdgather (`tdgather.api.liveness`)

    def fail(self, e: BaseException) -> bool:
        """Record the first failure; True when this one is it."""
        with self.lock:
            if self.failure is None:
                self.failure = e
                return True
            return False

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def add(self, filenames: Any, frame_idx: Any, frames: Any, ragged: Any = ()) -> None:
        self.check()
        self.store.add(filenames, frame_idx, frames, ragged=ragged)
        self._maybe_flush()

    def update(self, predictions: Mapping[str, Any], ragged: Any = ()) -> None:
        self.check()
        self.store.update(predictions, ragged=ragged)
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        """Send the chunk once its frames, and what its filenames cost beside them, reach ``chunk_bytes``.

        Or once its first frame is ``flush_every`` seconds old: a slow loop with small outputs sends
        (and rank dst writes) them in time, not only at close (`Settings.commit_every`).
        """
        now = time.monotonic()
        if self.chunk_since is None:
            self.chunk_since = now
        full = self.store.nbytes + _CHUNK_BYTES_PER_FILE * len(self.store.names) >= self.chunk_bytes
        if full or (len(self.store) and now - self.chunk_since >= self.flush_every):
            self.put(self._chunk(self.store))
            self.store = self._new_store()
            self.chunk_since = None

    def _new_store(self) -> FrameStore:
        return FrameStore(self.copy, self.saved.layouts, self.fixed)

    def _chunk(self, store: FrameStore) -> Any:
        """What goes on the queue for a full chunk."""
        return store

    def put(self, item: Any) -> None:
        """From the user's thread: queue an item, waiting while the queue is full, not past a failure."""
        with self.progress.waiting():
            while True:
                try:
                    self.queue.put(item, timeout=0.05)
                    return
                except queue.Full:
                    if self.failure is not None:
                        raise self.failure from None


class Sender(_Side):
    """A rank other than dst: 1. wait for dst's ready, 2. send chunks behind the loop, 3. done or error.

    `Uplink` is a block writer's stream to the coordinator.
    """

    relay = False  # a stream that carries no frames (`Uplink`)

    def __init__(self, settings: Settings, call: Call) -> None:
        super().__init__(
            settings.chunk_bytes, settings.max_pending, settings.copy, settings.fixed, settings.flush_every
        )
        self.timeout, self.dst = settings.timeout, settings.dst
        self.ch = call.channel(settings.dst)  # its send and receive sequences are independent
        self.heartbeat = heartbeat_interval(self.timeout)
        self.frames = 0
        self.pending_peak = 0
        self.on_fail: Any = None  # a writer's: its own Destination fails with it
        self.done: dict = {}  # what ``done`` carries besides the frames: a writer's part
        self.stalled: StalledError | None = None  # the loop is stuck: the send thread ends the stream
        ready = self.ch.recv_answer()  # 1. rank dst says whether the output can be written
        if ready.kind == Kind.ERROR:
            raise peer_error(self.ch, ready.header)
        if "saved" in ready.header:
            self.saved = Saved.from_wire(ready.header["saved"], settings.dst)
            self.store = self._new_store()
        self.run = check_run(ready.header["run"], settings.dst) if "run" in ready.header else None
        # rank dst on this host: chunks go through shared memory segments (`tdgather.comm.shm`)
        here = host_token()
        self.segments = SegmentWriter() if here is not None and ready.header.get("host") == here else None
        self.answer = None
        self.joiner = Joiner(reuse=True)
        self.thread = Job(self._send_loop, "tdgather-send")
        self.watcher = Job(self._watch, "tdgather-answer")
        self.thread.start()
        self.watcher.start()

    def put(self, item: Any) -> None:
        """Queue a chunk (waiting on back-pressure) and keep the peak queue depth."""
        super().put(item)
        self.pending_peak = max(self.pending_peak, self.queue.qsize())

    def follow(self, on_fail: Any) -> None:
        """A writer's uplink: ``on_fail`` (its Destination's) runs when this stream fails (at once if it has)."""
        self.on_fail = on_fail
        if self.failure is not None:
            on_fail(self.failure)

    def fail(self, e: BaseException) -> bool:
        """Record the first failure (True when this one is it); a writer's Destination fails with it."""
        first = super().fail(e)
        if first and self.on_fail is not None:
            self.on_fail(e)
        return first

    def stall(self, e: StalledError) -> None:
        """From the watchdog: the loop is stuck. The queued chunks go, then ``error`` ends the stream."""
        if self.fail(e):
            self.stalled = e

    def _send_loop(self) -> None:
        last = time.monotonic()
        try:
            while True:
                if self.stalled is not None and self.queue.empty():  # the loop will not end the stream
                    self.ch.wait(end_stream(self.ch, error=self.stalled), "the error message")
                    return
                if self.failure is not None and (self.answer is not None or self.relay):  # end the stream now,
                    raise self.failure  # not at the loop's next add(), which may be far off
                try:
                    item = self.queue.get(timeout=_POLL)
                except queue.Empty:
                    if time.monotonic() - last >= self.heartbeat:
                        self.ch.wait(self.ch.send(Kind.DATA, HEARTBEAT), "a heartbeat")
                        last = time.monotonic()
                    continue
                last = time.monotonic()
                if item is _CLOSE:
                    self.ch.wait(end_stream(self.ch, self.frames, **self.done), "the done message")
                    return
                if isinstance(item, BaseException):
                    self.ch.wait(end_stream(self.ch, error=item), "the error message")
                    return
                self.ch.wait(send_frames(self.ch, pack(item), self.joiner, self.segments), "a chunk")
                self.joiner.wait(self.ch)
                self.frames += len(item)
        except BaseException as e:
            self.fail(e)
            if not isinstance(e, PeerLostError):  # the stream still works: end it, so dst need not wait
                try:
                    self.ch.wait(end_stream(self.ch, error=e), "the error message")
                except PeerLostError:
                    pass

    def _watch(self) -> None:
        try:
            answer = self.ch.recv_answer()  # as long as dst sends heartbeats, however long its work takes
        except BaseException as e:
            self.fail(e)
            return
        if answer.kind == Kind.ERROR:
            self.fail(peer_error(self.ch, answer.header))
        self.answer = answer  # after the failure is recorded: the send loop reads both

    def status(self) -> CollectorStatus:
        """This sender's progress."""
        return CollectorStatus(pending_peak=self.pending_peak)

    def close(self, **done: Any) -> None:
        """Flush, send ``done`` (with ``done``'s items), and wait for dst's answer (raises if it is ``error``)."""
        self.check()
        self.done = done
        if len(self.store):
            self.put(self.store)
        self.put(_CLOSE)
        self._join_send_thread()
        self.check()
        self.watcher.join()  # ends with dst's answer, or once dst is silent for the timeout
        self._clean_segments()
        self.check()

    def abort(self, exc: BaseException) -> None:
        """Send what it holds, end the stream with ``error``, and wait (bounded) for dst's answer.

        The frames added before the failure are whole, so they go to dst, which keeps them in
        ``<path>.partial``; unless dst has failed already (it stops reading) or is lost.
        """
        self.fail(exc)
        deadline = time.monotonic() + self.timeout.total_seconds()
        if len(self.store):
            self._put_while_sending(self.store, deadline)
            self.store = self._new_store()
        self._put_while_sending(exc, deadline)
        self._join_send_thread()
        self.watcher.join(self.timeout.total_seconds())
        self._clean_segments()

    def _clean_segments(self) -> None:
        """Once dst has answered (it has read every data message), remove the segments it did not take."""
        if self.segments is not None and not self.watcher.is_alive():
            self.segments.cleanup()

    def _put_while_sending(self, item: Any, deadline: float) -> None:
        """Queue an item behind the unsent chunks; if the send loop ends or stalls first, drop them all."""
        while self.thread.is_alive() and time.monotonic() < deadline:
            try:
                self.queue.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue
        while not self.queue.empty():
            self.queue.get_nowait()

    def _join_send_thread(self) -> None:
        """Wait for the send thread: at most the timeout, and only briefly once dst has answered.

        After its answer, dst reads the rest of the stream, unless it stopped reading it (our bytes
        broke the protocol): then a send never completes, and waiting for it would only delay the error.
        """
        deadline = time.monotonic() + self.timeout.total_seconds()
        answered = None
        while self.thread.is_alive() and time.monotonic() < deadline:
            self.thread.join(0.05)
            if not self.watcher.is_alive():
                answered = answered or time.monotonic()
                if time.monotonic() - answered > _AFTER_ANSWER:
                    return


class Uplink(Sender):
    """A block writer's stream to the coordinator: no frames, only heartbeats, then ``done`` with its part.

    It ends with ``error`` as soon as the writer fails (`tdgather.format.parts` checks the part).
    """

    relay = True


class Destination(_Side):
    """Rank dst, the one writer: 1. check the output, answer ready, 2. receive and write, 3. index.

    With several writers (``ranks_per_writer``) the roles are its subclasses: `Coordinator` (rank
    dst, which writes the one index) and `BlockWriter` (every other block's first rank).
    """

    writer_number: int | None = None  # numbers this writer's shards (several writers)

    def __init__(self, settings: Settings, call: Call | None, rank: int, peers: list[int]) -> None:
        super().__init__(
            settings.chunk_bytes, settings.max_pending, settings.copy, settings.fixed, settings.flush_every
        )
        _return_freed_memory()
        col = self.settings = settings
        self.rank, self.start = rank, time.perf_counter()
        self.channels = {p: call.channel(p) for p in peers} if call is not None else {}
        self.answers = Answers(self.channels, heartbeat_interval(col.timeout))
        self.policy = col.duplicates
        self.local_ended = False
        self.write_failed = False
        self.received = dict.fromkeys(sorted([rank, *peers]), 0)
        self.received_bytes = dict.fromkeys(sorted([rank, *peers]), 0)
        self.shared_chunks = 0  # chunks whose pieces came in a shared memory segment
        # peers that failed themselves: answered only once what they sent is saved, so that they stay
        # alive until then (launchers stop every process as soon as one exits with an error)
        self.held: set[int] = set()
        self.duplicates = DuplicateCounts()  # dropped within spills; the writer counts those against the disk
        self.pending = Pending()  # the shard being gathered from spills, until it is written
        self.pool = BufferPool(col.pool_bytes)  # received buffers, reused within the budget
        sweep()  # segments left on this host by processes that died (a sender killed mid-write)
        self.peer_segments = PeerSegments()  # the peers' segment writers: a lost peer's are removed at the end
        try:
            self.user_metadata = user_metadata(col.metadata)  # before any file: a bad value fails every rank now
            self.writer = self._make_sink()
        except BaseException as e:
            self.answers.answer_all(Kind.ERROR, error_header(e))
            raise
        self.saved = self._saved()
        self.store = self._new_store()
        late = self.answers.send_all(Kind.DONE, self._ready())  # 1. ready, with what a resumed run saved
        if late:  # its pair timed out, and gloo closes them all: name it, rather than let the others blame us
            waited, limit = time.perf_counter() - self.start, col.timeout.total_seconds()
            why = (
                f"it did not open its Collector within {limit:g} s of rank {rank}: every rank must enter "
                "`with Collector(...)` within the timeout of the others (open it before the loop, not after a "
                "long step), or pass a larger timeout=; or it failed, or is in another call"
                if waited >= 0.9 * limit
                else f"its connection closed after {waited:.1f} s, before it opened its Collector: it probably "
                "failed or died before this call (its log has the error)"
            )
            error = PeerLostError(min(late), "PeerLost", why, self.channels[min(late)].peer_global)
            self.answers.answer_all(Kind.ERROR, error_header(error))
            self.writer.discard()  # nothing was received: leave nothing that blocks a rerun
            raise error
        self.answers.start()
        # a bar on a terminal, else lines in the log (at least every commit)
        self.report = Report(col.progress, self._describe, min(LOG_EVERY, col.commit_every))
        self.receivers = [Job(self._receive_loop, f"tdgather-recv-{p}", (p,)) for p in peers]
        self.writer_thread = Job(self._write_loop, "tdgather-write")
        for t in [*self.receivers, self.writer_thread]:
            t.start()

    def _make_sink(self, **role: Any) -> Any:
        col = self.settings
        return (col.sink or DatasetWriter)(
            col.path,
            overwrite=col.overwrite,
            max_shard_bytes=col.max_shard_bytes,
            duplicates=self.policy,
            writer=self.writer_number,
            **({"storage_options": col.storage_options} if col.storage_options else {}),
            **({"fixed": True} if col.fixed else {}),
            **({"resume": col.resume} | role),
        )

    def _saved(self) -> Saved:
        """What earlier attempts saved, as every rank of its block gets it."""
        return self.writer.saved

    def _ready(self) -> dict[str, Any]:
        """The ready answer: the output can be written, what a resumed run saved, and (segments on) this host."""
        out: dict[str, Any] = {"frames": 0, "saved": self.saved.to_wire()} if self.saved else {"frames": 0}
        host = host_token()
        return {**out, "host": host} if host is not None else out

    def _end_of(self, peer: int, msg: Any) -> None:
        """A peer's ``done`` (a plain sender's carries nothing more)."""

    def _check_frames(self, peer: int, msg: Any) -> None:
        """A peer's data message, before its frames are read (any peer may send frames)."""

    @property
    def all_duplicates(self) -> DuplicateCounts:
        """Copies dropped: in the merges, and against shards already written."""
        return self.duplicates + self.writer.duplicates

    def _chunk(self, store: FrameStore) -> Any:
        return ("local", self.rank, store)

    def _receive_loop(self, peer: int) -> None:
        ch, frames, end = self.channels[peer], 0, None
        try:
            while True:
                msg = ch.recv()
                if msg.kind != Kind.DATA:
                    expect_done(ch, msg, frames)
                    self._end_of(peer, msg)
                    break
                self._check_frames(peer, msg)
                if msg.header.groups:  # after a failure too: what arrives is still written
                    taken: list = []
                    parts = read_frames(ch, msg, functools.partial(self.pool.take, into=taken))
                    self.shared_chunks += msg.header.shm is not None
                    self.peer_segments.note(peer, msg.header.shm)
                    frames += msg.header.num_frames
                    self.queue.put(("parts", peer, (parts, taken)))
        except BaseException as e:
            end = e
            if isinstance(e, PeerLostError):
                self.answers.lost.add(peer)
            elif isinstance(e, PeerError) and e.rank == peer:
                self.held.add(peer)
        self.queue.put(("end", peer, end))  # the writer consumes until every source has ended

    def _write_loop(self) -> None:
        """Write everything that arrives, after a failure elsewhere too, until a write itself fails.

        Each spill is merged into the shard being gathered (``self.pending``), which is written once
        full (`tdgather.api.settings.Pending`), when due, and at the end.
        """
        spill, open_sources = Spill(), {*self.channels, self.rank}
        tick = min(1.0, self.settings.commit_every / 4)
        while open_sources:
            self.report.tick()
            try:
                kind, src, item = self.queue.get(timeout=tick)
            except queue.Empty:  # nothing arrived: what is held is still written in time (`Settings.commit_every`)
                if spill.due(self.settings) or self.pending.due(self.settings):
                    spill = self._merge(spill, write=True)
                continue
            if kind == "end":
                open_sources.discard(src)
                if item is not None:
                    self.fail_all(item)
                continue
            if self.write_failed:
                continue  # drain
            try:
                parts, buffers = (item.parts(src), []) if kind == "local" else item
                frames = sum(p.num_frames for p in parts)
                size = sum(p.nbytes for p in parts)
                self.received[src] += frames
                self.received_bytes[src] += size
                self._progress(frames)
            except BaseException as e:
                self.write_failed = True
                self.fail_all(e)
                continue
            spill.add(parts, buffers, size + bookkeeping_bytes(parts, frames), size)
            due = spill.due(self.settings) or self.pending.due(self.settings)
            if spill.full(self.settings, self.pending.nbytes) or due:
                spill = self._merge(spill, write=due)
        if spill.parts or self.pending.groups:
            self._spill(spill, write=True)

    def _merge(self, spill: Spill, write: bool) -> Spill:
        """`_spill`, then its buffers go back to the pool (merged or written: they take the next chunks)."""
        self._spill(spill, write)
        self.pool.give(spill.buffers)
        return Spill()

    def _spill(self, spill: Spill, write: bool = False) -> None:
        """Merge the spill into the shard being gathered (``self.pending``); write that shard when full, or ``write``.

        The shard's frames come first, then the spill's lowest rank first, so the copy of a
        duplicate that came first is kept. A shard that is written is merged ``by_reference``:
        large rows are written straight from the received buffers (`tdgather.core.merge.Rows`),
        small ones merged into new buffers first; a shard that gathers on is a copy, and the
        received buffers go back to the pool, less its full shards of ``max_shard_bytes``, written now.

        A conflict fails the run, but the writer is sound: it goes on writing what arrives, so
        that what was received is saved. Of a duplicate the policy refuses, one copy is kept; of a
        filename sent with two layouts, the frames of the layout that came first (in the shard
        being gathered, lowest rank first within a spill; the one on disk, after). A failed write stops writing.
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
            self.fail_all(e)
        for _, error in mismatches.values():
            self.fail_all(error)

    def _write(self, merged: Merged, mismatches: Mismatches) -> None:
        """Write merged frames as shards; a copy on disk that the policy refuses fails the run, and they are written."""
        try:
            self.writer.write(merged, None, mismatches)
        except DuplicateFrameError as e:  # raised before anything is written
            self._keep_copies(e)
            self.writer.write(merged, None, mismatches)

    def _keep_copies(self, e: DuplicateFrameError) -> None:
        """A copy the policy refuses: the run fails, and from now on one copy of each frame is kept."""
        self.fail_all(e)
        self.policy = DuplicatePolicy("keep")
        self.writer.set_policy(self.policy)

    def _progress(self, frames: int) -> None:
        self.report.frames(frames)

    def _describe(self) -> str:
        """The progress text after the frame count: bytes, shards written, per rank (up to 8 ranks)."""
        ranks = self.received_bytes.items()
        per_rank = " ".join(f"r{r}:{self.received[r]}/{b / 1e6:.0f}MB" for r, b in ranks) if len(ranks) <= 8 else ""
        total = sum(self.received_bytes.values()) / 1e6
        return f"{total:.0f} MB, {len(self.writer.shards)} shards {per_rank}".rstrip()

    def fail_all(self, e: BaseException) -> bool:
        """Fail every stream: record ``e`` and answer every sender ``error``; True when ``e`` is the first failure."""
        first = self.fail(e)
        if first:  # every sender learns at once; one that failed itself, after its frames are saved
            self.answers.answer_all(Kind.ERROR, error_header(e), skip=self.held)
        return first

    def stall(self, e: StalledError) -> None:
        """From the watchdog: this rank's loop is stuck; every peer is answered ``error`` naming it.

        What reached this rank is written as it arrives; the shards it commits stay readable with
        ``incomplete=True``, as when it is killed (the loop that would write the record is stuck).
        """
        self.fail_all(e)

    def status(self) -> CollectorStatus:
        """Rank dst's (or a writer's) progress."""
        return CollectorStatus(frames_received=dict(self.received), shards=len(self.writer.shards))

    def close(self) -> CollectorSummary | None:
        """Flush its own frames, wait for every peer, commit the index, answer ``done``; return the summary.

        A writer other than the coordinator returns None, once the coordinator has answered.
        """
        self.check()
        closing = time.perf_counter()
        if len(self.store):
            self.put(self._chunk(self.store))
        self._end_local()
        self.writer_thread.join()
        for t in self.receivers:
            t.join()
        self.report.close()
        self.check()
        combining = time.perf_counter()
        self._combine()
        combined = time.perf_counter() - combining
        dups = self.all_duplicates
        meta = {USER_KEY: self.user_metadata, "duplicates_dropped": dups.dropped, "duplicates": dups.to_json()}
        self.writer.commit(meta)
        summary = self._answer_done(dups, closing, combined)
        self.peer_segments.remove(self.answers.lost)  # a peer lost after its last chunk: nobody else removes them
        return summary

    def _combine(self) -> None:
        """Before the commit: nothing, with one writer (`Coordinator` reads the others' shards here)."""

    def _answer_done(self, dups: DuplicateCounts, closing: float, combined: float) -> CollectorSummary | None:
        """Once committed: answer every peer ``done``; return the summary."""
        self.answers.answer_all(Kind.DONE, {"frames": self.writer.frames})
        self.answers.stop()
        end = time.perf_counter()
        overlap = self._overlap(dups)
        if overlap is not None:
            log.warning("tdgather: %s", overlap)
        return CollectorSummary(
            path=str(self.settings.path),
            frames=self.writer.frames,
            bytes=self.writer.nbytes,
            duplicates_dropped=dups.dropped,
            frames_per_rank=dict(self.received),
            shards=len(self.writer.shards),
            seconds=end - self.start,
            close_seconds=end - closing,
            duplicates=dups,
            combine_seconds=combined,
            shared_chunks=self.shared_chunks,
            warnings=(overlap,) if overlap is not None else (),
        )

    def _overlap(self, dups: DuplicateCounts) -> str | None:
        """More copies dropped than a padding sampler makes: the ranks' shares overlapped (`overlap_warning`).

        Not for a resumed run, which drops the frames sent again that earlier attempts saved.
        """
        ranks = len(self.received)
        if dups.dropped <= ranks - 1 or self.saved:  # within any padding, whatever a filename's frames
            return None
        catalog = getattr(self.writer, "catalog", None)
        most = (
            catalog.max_frames()
            if catalog is not None
            else max((f["frames"] for f in self.writer.files.values()), default=0)
        )
        return overlap_warning(dups.dropped, ranks, most)

    def _end_local(self) -> None:
        if not self.local_ended:
            self.local_ended = True
            self.queue.put(("end", self.rank, None))

    def abort(self, exc: BaseException) -> None:
        """Answer ``error`` to every peer, write what arrives until their streams end, keep the shards.

        Nothing received is lost: rank dst's own frames, every chunk received before the failure
        and those its peers still send are committed to ``<path>.partial`` and listed in
        ``tdgather.incomplete.json`` (also after a failed write, when it can still be written).
        No index is written.
        """
        self.fail_all(exc)
        if len(self.store) and not self.local_ended:
            self.queue.put(self._chunk(self.store))  # the writer drains the queue, so this returns
            self.store = self._new_store()
        self._end_local()
        self.writer_thread.join()
        for t in self.receivers:
            t.join()
        self.report.close()
        dups = self.all_duplicates
        meta = {
            USER_KEY: self.user_metadata,
            "frames_per_rank": self.received,
            "duplicates_dropped": dups.dropped,
            "duplicates": dups.to_json(),
        }
        try:
            with contextlib.suppress(OSError):  # the original error matters more than the list of what was saved
                self.writer.abort(self.failure, meta, rank=self.rank)
        finally:
            self.answers.answer_all(Kind.ERROR, error_header(self.failure))  # the held peers: saved now
            self.answers.stop()
            self.peer_segments.remove(self.answers.lost)  # a lost peer's ring stays in /dev/shm otherwise


class Coordinator(Destination):
    """Rank dst with several writers: the first writer's block, plus the other writers as peers.

    ``writers`` maps the peers that are writers to their numbers: they send no frames, only their
    part at the end (checked as any header), and the index covers every writer's shards.
    """

    def __init__(
        self, settings: Settings, call: Call, rank: int, peers: list[int], number: int, writers: Mapping[int, int]
    ) -> None:
        self.writer_number, self.writers, self.parts = number, dict(writers), {}
        super().__init__(settings, call, rank, peers)

    def _ready(self) -> dict[str, Any]:
        """The ready answer, with the run and attempt the writers write shards of."""
        return {**super()._ready(), "run": {"id": self.writer.run, "attempt": self.writer.attempt}}

    def _end_of(self, peer: int, msg: Any) -> None:
        """A writer's ``done`` carries its part."""
        if peer in self.writers:
            self.parts[peer] = check_part(msg.header.get("part"), peer, self.writers[peer])

    def _check_frames(self, peer: int, msg: Any) -> None:
        """A writer sends no frames."""
        if msg.header.groups and peer in self.writers:
            raise ProtocolError(peer, "header.groups", "none: a writer sends its part, not frames")

    def _combine(self) -> None:
        """Every writer's shards into the index, copies across writers resolved."""
        self.duplicates += self.writer.combine({self.writers[p]: part["shards"] for p, part in self.parts.items()})
        for part in self.parts.values():
            self.duplicates += counts_of(part["duplicates"])
            self.received.update((r, n) for r, n in part["frames_per_rank"])
        self.received = dict(sorted(self.received.items()))


class BlockWriter(Destination):
    """A block's first rank, not rank dst: it writes its block's frames as shards of its own.

    ``up`` is its `Uplink` to the coordinator, which gave it the run and attempt. It answers its
    peers only once the coordinator has answered it, so that every rank ends with one outcome.
    """

    def __init__(self, settings: Settings, call: Call, rank: int, peers: list[int], number: int, up: Uplink) -> None:
        self.writer_number, self.up = number, up
        super().__init__(settings, call, rank, peers)
        up.follow(self.fail_all)  # the coordinator's failure fails this block too

    def _make_sink(self, **role: Any) -> Any:
        return super()._make_sink(resume=False, part=self.up.run)

    def _saved(self) -> Saved:
        """What the coordinator said was saved."""
        return self.up.saved

    def fail_all(self, e: BaseException) -> bool:
        """Fail every stream of the block, and the uplink (the coordinator learns)."""
        first = super().fail_all(e)
        if first:
            self.up.fail(e)
        return first

    def _answer_done(self, dups: DuplicateCounts, closing: float, combined: float) -> None:
        """Its part to the coordinator, then the coordinator's answer to its peers."""
        frames_per_rank = [[r, n] for r, n in self.received.items()]
        self.up.close(
            part={"shards": self.writer.report(), "frames_per_rank": frames_per_rank, "duplicates": dups.to_json()}
        )
        self.answers.answer_all(Kind.DONE, {"frames": self.up.answer.header["frames"]})
        self.answers.stop()

    def abort(self, exc: BaseException) -> None:
        """As rank dst aborts, then the uplink ends with the error."""
        try:
            super().abort(exc)
        finally:
            self.up.abort(self.failure)
