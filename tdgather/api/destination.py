"""`Destination`: a writer in a `tdgather.Collector` call: rank dst, or a block's writer.

A writer opens its sink (`tdgather.storage.sink`: on rank dst it checks the output directory),
answers its peers ready, then receives each peer on its own thread, into buffers reused from a
`tdgather.core.pool.BufferPool`, and queues the chunks, its own loop's included, in a bounded
inbox that its write thread (`tdgather.api.writing.WriteLoop`) writes as shards. Until it answers,
it sends every peer a heartbeat; on its first failure it answers every peer ``error`` at once.
Which ranks are writers is `tdgather.api.roles`; the steps each takes, `tdgather.api.choreography`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import time
from typing import Any

from ..comm.groups import heartbeat_interval
from ..comm.protocol import expect_done, read_frames
from ..comm.shmfiles import PeerShm, host_token, sweep
from ..comm.transport import Answers, Call
from ..comm.wire import Kind, error_header
from ..core.duplicates import DuplicateCounts, overlap_warning
from ..core.metadata import USER_KEY, user_metadata
from ..core.pool import BufferPool
from ..errors import PeerError, PeerLostError, ProtocolError
from ..format.blocks import check_report, counts_of
from ..storage.saved import Saved
from ..storage.sink import Sink
from ..storage.writer import DatasetWriter
from .failure import Failure
from .jobs import Job
from .roles import Role
from .settings import CollectorStatus, CollectorSummary, Settings
from .writing import WriteLoop

__all__ = ["Destination"]

log = logging.getLogger("tdgather")


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


class Destination:
    """A writer: its peers' streams, its sink, its answers.

    1. ``open()``: check the metadata, open the sink, answer every peer ready (or ``error``, and raise);
    2. ``start()``: from now on the first failure answers every peer ``error``; start the
       heartbeats, a receive thread per peer and the write thread;
    3. its loop's chunks go into ``inbox`` (`tdgather.api.chunks.Chunks`);
    4. at close: ``finish()``, then on the coordinator ``combine()``, then ``commit()``,
       ``answer_done()``, and on rank dst ``summary()``; at abort: ``abort()``.

    ``role`` gives its peers, its writer number, and on the coordinator the other writers, whose
    streams carry their report, not frames. A block writer's sink joins the coordinator's run
    (``joins``: its id), and its peers get what the coordinator said was saved (``saved``).
    """

    def __init__(
        self,
        settings: Settings,
        call: Call | None,
        rank: int,
        role: Role,
        failure: Failure,
        joins: str | None = None,
        saved: Saved | None = None,
    ) -> None:
        self.settings, self.call, self.rank, self.role, self.failure = settings, call, rank, role, failure
        self.joins = joins  # a block writer's: the coordinator's run, which its sink writes shards of
        self.saved = saved  # what earlier attempts saved: the coordinator's word (a block writer), else the sink's
        self.inbox: queue.Queue = queue.Queue(maxsize=settings.max_pending)
        self.pool = BufferPool(settings.pool_bytes(len(role.peers)))  # received buffers, reused within the budget
        self.local_ended = False
        self.shared_chunks = 0  # chunks whose pieces came in a shared memory file
        # peers that failed themselves: answered only once what they sent is saved, so that they stay
        # alive until then (launchers stop every process as soon as one exits with an error)
        self.held: set[int] = set()
        self.reports: dict[int, dict] = {}  # the coordinator's: each other writer's report
        self.peer_shm = PeerShm()  # the peers' shm file writers: a lost peer's are removed at the end
        # open() adds the channels, answers, sink and write loop; start() the receive threads

    def open(self) -> None:
        """Check the metadata and open the sink; answer every peer ready, with what a resumed run saved.

        On a failure every peer is answered ``error``, and it raises.
        """
        _return_freed_memory()
        col = self.settings
        self.start_time = time.perf_counter()
        self.channels = {p: self.call.channel(p) for p in self.role.peers} if self.call is not None else {}
        self.answers = Answers(self.channels, heartbeat_interval(col.timeout))
        sweep()  # shm files left on this host by processes that died (a sender killed mid-write)
        try:
            self.user_metadata = user_metadata(col.metadata)  # before any file: a bad value fails every rank now
            self.sink = self._make_sink()
        except BaseException as e:
            self.answers.answer_all(Kind.ERROR, error_header(e))
            raise
        if self.saved is None:
            self.saved = self.sink.saved
        late = self.answers.send_all(Kind.DONE, self._ready())
        if late:  # its pair timed out, and gloo closes them all: name it, rather than let the others blame us
            waited, limit = time.perf_counter() - self.start_time, col.timeout.total_seconds()
            why = (
                f"it did not open its Collector within {limit:g} s of rank {self.rank}: every rank must enter "
                "`with Collector(...)` within the timeout of the others (open it before the loop, not after a "
                "long step), or pass a larger timeout=; or it failed, or is in another call"
                if waited >= 0.9 * limit
                else f"its connection closed after {waited:.1f} s, before it opened its Collector: it probably "
                "failed or died before this call (its log has the error)"
            )
            error = PeerLostError(min(late), "PeerLost", why, self.channels[min(late)].peer_global)
            self.answers.answer_all(Kind.ERROR, error_header(error))
            self.sink.discard()  # nothing was received: leave nothing that blocks a rerun
            raise error
        sources, writers = [self.rank, *self.role.peers], self.role.writers
        self.loop = WriteLoop(col, self.sink, self.inbox, self.pool, self.failure, sources, reporters=writers)

    def _make_sink(self) -> Sink:
        """The sink: it checks the output (rank dst), or writes shards of the coordinator's run (a block writer)."""
        col = self.settings
        resume = {"resume": col.resume} if self.joins is None else {"resume": False, "joins": self.joins}
        return (col.sink or DatasetWriter)(
            col.path,
            overwrite=col.overwrite,
            max_shard_bytes=col.max_shard_bytes,
            duplicates=col.duplicates,
            writer=self.role.number,
            **({"storage_options": col.storage_options} if col.storage_options else {}),
            **({"fixed": True} if col.fixed else {}),
            **({"append": True} if col.append else {}),
            **({"write_threads": col.write_threads} if col.write_threads > 1 else {}),
            **resume,
        )

    def _ready(self) -> dict[str, Any]:
        """The ready answer: the output can be written, what a resumed run saved, (shm files on) this host.

        The coordinator adds the run and attempt that the other writers write shards of.
        """
        out: dict[str, Any] = {"frames": 0, "saved": self.saved.to_wire()} if self.saved else {"frames": 0}
        host = host_token()
        out = {**out, "host": host} if host is not None else out
        if self.role.writers:
            out["run"] = {"id": self.sink.run, "attempt": self.sink.attempt}
        return out

    def start(self) -> None:
        """Answer every peer ``error`` on the first failure; start the heartbeats, the receive threads, the writes."""
        self.failure.listen(self._answer_error)
        self.answers.start()
        self.loop.start()
        self.receivers = [Job(self._receive_loop, f"tdgather-recv-{p}", (p,)) for p in self.role.peers]
        for t in self.receivers:
            t.start()

    def _answer_error(self, e: BaseException) -> None:
        """The first failure: every peer learns at once; one that failed itself, after its frames are saved."""
        self.answers.answer_all(Kind.ERROR, error_header(e), skip=self.held)

    def _receive_loop(self, peer: int) -> None:
        ch, frames, end = self.channels[peer], 0, None
        writer = peer in self.role.writers  # the coordinator's: another writer, which sends its report, not frames
        try:
            while True:
                msg = ch.recv()
                if msg.kind != Kind.DATA:
                    expect_done(ch, msg, frames)
                    if writer:
                        self.reports[peer] = check_report(msg.header.get("report"), peer, self.role.writers[peer])
                    break
                if msg.header.groups and writer:
                    raise ProtocolError(peer, "header.groups", "none: a writer sends its report, not frames")
                if msg.header.groups:  # after a failure too: what arrives is still written
                    taken: list = []
                    parts = read_frames(ch, msg, functools.partial(self.pool.take, into=taken))
                    self.shared_chunks += msg.header.shm is not None
                    self.peer_shm.note(peer, msg.header.shm)
                    frames += msg.header.num_frames
                    self.inbox.put(("parts", peer, (parts, taken)))
        except BaseException as e:
            end = e
            if isinstance(e, PeerLostError):
                self.answers.lost.add(peer)
            elif isinstance(e, PeerError) and e.rank == peer:
                self.held.add(peer)
        self.inbox.put(("end", peer, end))  # the writer consumes until every source has ended

    def status(self) -> CollectorStatus:
        """Its progress: frames received per rank, shards written."""
        return CollectorStatus(frames_received=dict(self.loop.received), shards=len(self.sink.shards))

    def finish(self) -> None:
        """At close: wait until every stream, its own too, has ended, and what arrived is written; raise a failure."""
        self._drain()
        self.failure.check()

    def _drain(self) -> None:
        """Its own stream ends (its loop queued its last chunk); wait for the others, and the writes."""
        if not self.local_ended:
            self.local_ended = True
            self.inbox.put(("end", self.rank, None))
        self.loop.join()
        for t in self.receivers:
            t.join()
        self.loop.report.close()

    def combine(self) -> None:
        """The coordinator's: every writer's shards into the index, copies across writers resolved."""
        loop, writers = self.loop, self.role.writers
        loop.duplicates += self.sink.combine({writers[p]: report["shards"] for p, report in self.reports.items()})
        for report in self.reports.values():
            loop.duplicates += counts_of(report["duplicates"])
            loop.received.update((r, n) for r, n in report["frames_per_rank"])
        loop.received = dict(sorted(loop.received.items()))

    def commit(self) -> DuplicateCounts:
        """Commit what it wrote (rank dst: the index; a block writer: its shards, durable); the copies dropped."""
        dups = self.loop.all_duplicates
        self.sink.commit(
            {USER_KEY: self.user_metadata, "duplicates_dropped": dups.dropped, "duplicates": dups.to_json()}
        )
        return dups

    def report(self, dups: DuplicateCounts) -> dict[str, Any]:
        """A block writer's report to the coordinator (`tdgather.format.blocks`): shards, frames per rank, copies."""
        frames_per_rank = [[r, n] for r, n in self.loop.received.items()]
        return {"shards": self.sink.report(), "frames_per_rank": frames_per_rank, "duplicates": dups.to_json()}

    def answer_done(self, frames: int) -> None:
        """Answer every peer ``done`` with the run's frame count; stop the heartbeats."""
        self.answers.answer_all(Kind.DONE, {"frames": frames})
        self.answers.stop()

    def summary(self, dups: DuplicateCounts, closing: float, combined: float) -> CollectorSummary:
        """Rank dst's summary of the call; ``closing``: when close began; ``combined``: seconds combining."""
        end, sink = time.perf_counter(), self.sink
        overlap = self._overlap(dups)
        if overlap is not None:
            log.warning("tdgather: %s", overlap)
        return CollectorSummary(
            path=str(self.settings.path),
            frames=sink.frames,
            bytes=sink.nbytes,
            duplicates_dropped=dups.dropped,
            frames_per_rank=dict(self.loop.received),
            shards=len(sink.shards),
            seconds=end - self.start_time,
            close_seconds=end - closing,
            duplicates=dups,
            combine_seconds=combined,
            shared_chunks=self.shared_chunks,
            warnings=(overlap,) if overlap is not None else (),
            snapshot=getattr(sink, "snapshot", None),  # a DatasetWriter's, appending; a custom sink may have none
        )

    def _overlap(self, dups: DuplicateCounts) -> str | None:
        """More copies dropped than a padding sampler makes: the ranks' shares overlapped (`overlap_warning`).

        Not for a resumed run, which drops the frames sent again that earlier attempts saved.
        """
        ranks = len(self.loop.received)
        if dups.dropped <= ranks - 1 or self.saved:  # within any padding, whatever a filename's frames
            return None
        catalog = getattr(self.sink, "catalog", None)
        most = (
            catalog.max_frames()
            if catalog is not None
            else max((f["frames"] for f in self.sink.files.values()), default=0)
        )
        return overlap_warning(dups.dropped, ranks, most)

    def remove_lost_shm(self) -> None:
        """The segments of a peer lost after its last chunk: nobody else removes them."""
        self.peer_shm.remove(self.answers.lost)

    def abort(self, held: Any = None) -> None:
        """Write what arrives until every stream ends, keep the shards, answer every peer ``error``.

        Nothing received is lost: its own frames (``held``, from `tdgather.api.chunks.Chunks.take`),
        every chunk received before the failure and those its peers still send are committed to
        ``<path>.partial`` and listed in ``tdgather.incomplete.json`` (also after a failed write,
        when it can still be written). No index is written.
        """
        if held is not None and not self.local_ended:
            self.inbox.put(held)  # the write thread drains the inbox, so this returns
        self._drain()
        dups = self.loop.all_duplicates
        meta = {
            USER_KEY: self.user_metadata,
            "frames_per_rank": self.loop.received,
            "duplicates_dropped": dups.dropped,
            "duplicates": dups.to_json(),
        }
        try:
            with contextlib.suppress(OSError):  # the original error matters more than the list of what was saved
                self.sink.abort(self.failure.error, meta, rank=self.rank)
        finally:
            self.answers.answer_all(Kind.ERROR, error_header(self.failure.error))  # the held peers: saved now
            self.answers.stop()
            self.remove_lost_shm()  # a lost peer's ring stays in /dev/shm otherwise
