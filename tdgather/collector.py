"""`Collector`: gather while the inference loop runs, with bounded memory on rank ``dst``.

Call order, on every rank of the group:

1. ``open()`` (entering the ``with`` block): rank ``dst`` checks the output directory and
   answers every peer ``done`` (ready) or ``error``. Nothing is sent before that.
2. ``add()`` / ``update()`` in the loop: frames go into a `FrameStore`. Every
   ``chunk_bytes`` the chunk is handed to a background thread, which packs and sends it.
   A sender holds at most ``max_pending`` unsent chunks: a full queue makes ``add()`` wait.
   An idle sender sends an empty ``data`` message every ``timeout / 4``, so that rank
   ``dst`` can tell a slow rank from a stopped one.
3. Rank ``dst`` receives every peer on its own thread. A writer thread buffers the parts
   and, when the buffer passes its share of ``memory_budget``, merges it and commits shards
   (`DatasetWriter`). A filename may so span several shards, as segments.
4. ``close()`` (leaving the block): senders flush and send ``done``; rank ``dst`` writes the
   last shard and the index, answers each peer, and returns a `CollectorSummary`.

On an error anywhere (an exception in the block, a failed or lost peer), every rank raises
within the timeout. Rank ``dst`` answers ``error`` to every peer at once, drains what they
still send, keeps the shards already committed in ``<path>.partial``, and writes no index.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

from .errors import PeerError, PeerLostError, ProtocolError
from .merge import merge
from .sink import DEFAULT_SHARD_BYTES, DatasetWriter
from .store import FrameStore
from .transport import Channel, as_timeout, transport_group
from .wire import Kind, error_header, local_parts, pack, unpack

__all__ = ["Collector", "CollectorSummary"]

log = logging.getLogger("tdgather")
_ANSWER_WAIT = timedelta(days=30)  # a sender waits this long for rank dst's final answer
_CLOSE = object()


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

    @property
    def throughput_mb_s(self) -> float:
        """Frame bytes written per second, from ``open()`` to the end of ``close()``."""
        return self.bytes / 1e6 / self.seconds if self.seconds else 0.0

    def __str__(self) -> str:
        per_rank = ", ".join(f"{r}: {n}" for r, n in self.frames_per_rank.items())
        return (
            f"tdgather: {self.frames} frames, {self.bytes / 1e6:.1f} MB, {self.duplicates_dropped} duplicates "
            f"dropped, per rank {{{per_rank}}}, {self.shards} shards in {self.path}, {self.seconds:.2f} s "
            f"({self.throughput_mb_s:.1f} MB/s), close {self.close_seconds:.3f} s"
        )


class Collector:
    """Stream every rank's frames to rank ``dst`` during the loop; rank ``dst`` writes the dataset.

    Example:
        >>> with tdgather.Collector("out/epoch_3") as col:  # doctest: +SKIP
        ...     for batch in loader:
        ...         col.add(batch["filename"], batch["frame_idx"], model(batch["video"].cuda()))

    Args:
        path: the dataset directory (used on rank ``dst``; see `tdgather.save` for the layout).
        dst: the group rank that receives and writes.
        group: the process group (default: the world); NCCL groups get a side gloo group.
        timeout: seconds (or a timedelta) any single wait may take; default 30 minutes.
        overwrite: replace an existing dataset, atomically, when the new one is complete.
        memory_budget: bytes rank ``dst`` may hold above its baseline (default 1 GiB).
        chunk_bytes: a sender sends its frames every this many bytes (default from the budget).
        max_pending: unsent chunks a rank may hold before ``add()`` waits.
        max_shard_bytes: the largest shard rank ``dst`` writes.
        progress: a progress bar on rank ``dst``; default: only when stderr is a terminal.
        log_summary: log the summary (logger ``"tdgather"``) when closing.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        dst: int = 0,
        group: Any = None,
        timeout: float | timedelta | None = None,
        overwrite: bool = False,
        memory_budget: int = 1 << 30,
        chunk_bytes: int | None = None,
        max_pending: int = 2,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        progress: bool | None = None,
        log_summary: bool = False,
    ) -> None:
        self.path, self.dst, self.group = Path(path), dst, group
        self.timeout = as_timeout(timeout)
        self.overwrite, self.memory_budget, self.max_pending = overwrite, memory_budget, max(1, max_pending)
        self.max_shard_bytes, self.progress, self.log_summary = max_shard_bytes, progress, log_summary
        self._chunk_bytes = chunk_bytes
        self._side: _Sender | _Destination | None = None
        self.summary: CollectorSummary | None = None  # set by close() on rank dst

    def open(self) -> Collector:
        """Start collecting (what entering the ``with`` block does). Called by every rank."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1
        pg = transport_group(self.group) if distributed else None
        rank, world = (dist.get_rank(pg), dist.get_world_size(pg)) if distributed else (0, 1)
        if not 0 <= self.dst < world:
            raise ValueError(f"dst: expected a group rank in 0..{world - 1}, got {self.dst}")
        chunk = self._chunk_bytes or min(64 << 20, max(256 << 10, self.memory_budget // (8 * (world + 1))))
        if rank == self.dst:
            self._side = _Destination(self, pg, rank, [p for p in range(world) if p != rank], chunk)
        else:
            self._side = _Sender(self, pg, chunk)
        return self

    def add(self, filenames: str | Sequence[str], frame_idx: Any, frames: Any) -> None:
        """Add a batch of B frames (as `FrameStore.add`); returns quickly, waits only on back-pressure."""
        self._active().add(filenames, frame_idx, frames)

    def update(self, predictions: Mapping[str, Any]) -> None:
        """Add ``{filename: (frame_idx, value)}`` or ``{filename: [(frame_idx, value), ...]}``."""
        self._active().update(predictions)

    def close(self) -> CollectorSummary | None:
        """Flush and finish; on rank ``dst`` write the index and return the summary, elsewhere None."""
        side, self._side = self._active(), None
        try:
            self.summary = side.close()
        except BaseException as e:
            side.abort(e)
            raise
        return self.summary

    def abort(self, exc: BaseException) -> None:
        """Stop because of ``exc``: tell every rank, keep committed shards, write no index."""
        side, self._side = self._side, None
        if side is not None:
            side.abort(exc)

    def __enter__(self) -> Collector:
        return self.open()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(exc)

    def _active(self) -> _Sender | _Destination:
        if self._side is None:
            raise RuntimeError("Collector is not open: use it as `with Collector(...) as col:` or call open()")
        return self._side


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

    def __init__(self, chunk_bytes: int, max_pending: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.store = FrameStore()
        self.queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self.failure: BaseException | None = None
        self.lock = threading.Lock()

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

    def add(self, filenames: Any, frame_idx: Any, frames: Any) -> None:
        self.check()
        self.store.add(filenames, frame_idx, frames)
        self._maybe_flush()

    def update(self, predictions: Mapping[str, Any]) -> None:
        self.check()
        self.store.update(predictions)
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self.store.nbytes >= self.chunk_bytes:
            self.put(self.store)
            self.store = FrameStore()

    def put(self, item: Any) -> None:
        """From the user's thread: queue an item, waiting while the queue is full, not past a failure."""
        while True:
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                if self.failure is not None:
                    raise self.failure from None


class _Sender(_Side):
    def __init__(self, col: Collector, pg: Any, chunk_bytes: int) -> None:
        super().__init__(chunk_bytes, col.max_pending)
        self.timeout, self.dst = col.timeout, col.dst
        self.out = Channel(pg, col.dst, col.timeout)
        self.back = Channel(pg, col.dst, col.timeout)
        self.heartbeat = min(self.timeout.total_seconds() / 4, 30.0)
        self.frames = 0
        self.pending_peak = 0
        ready = self.back.recv()  # 1. rank dst says whether the output can be written
        if ready.kind == Kind.ERROR:
            raise PeerError(col.dst, ready.header["type"], ready.header["message"])
        self.answer = None
        self.thread = threading.Thread(target=self._send_loop, name="tdgather-send", daemon=True)
        self.watcher = threading.Thread(target=self._watch, name="tdgather-answer", daemon=True)
        self.thread.start()
        self.watcher.start()

    def put(self, item: Any) -> None:
        super().put(item)
        self.pending_peak = max(self.pending_peak, self.queue.qsize())

    def _send_loop(self) -> None:
        try:
            while True:
                try:
                    item = self.queue.get(timeout=self.heartbeat)
                except queue.Empty:
                    self.out.wait(self.out.send(Kind.DATA, {"parts": []}), "a heartbeat")
                    continue
                if item is _CLOSE:
                    self.out.wait(self.out.send(Kind.DONE, {"frames": self.frames}), "the done message")
                    return
                if isinstance(item, BaseException):
                    self.out.wait(self.out.send(Kind.ERROR, error_header(item)), "the error message")
                    return
                header, payload = pack(item)
                self.out.wait(self.out.send(Kind.DATA, header, payload), "a chunk")
                self.frames += len(item)
        except BaseException as e:
            self.fail(e)
            if not isinstance(e, PeerLostError):  # the stream still works: end it, so dst need not wait
                try:
                    self.out.wait(self.out.send(Kind.ERROR, error_header(e)), "the error message")
                except PeerLostError:
                    pass

    def _watch(self) -> None:
        try:
            self.answer = self.back.recv(first_wait=_ANSWER_WAIT)
        except BaseException as e:
            self.fail(e)
            return
        if self.answer.kind == Kind.ERROR:
            self.fail(PeerError(self.dst, self.answer.header["type"], self.answer.header["message"]))

    def close(self) -> None:
        self.check()
        if len(self.store):
            self.put(self.store)
        self.put(_CLOSE)
        self.thread.join()
        self.check()
        self.watcher.join(self.timeout.total_seconds())
        if self.watcher.is_alive():
            self.fail(PeerLostError(self.dst, "PeerLost", f"no answer after {self.timeout.total_seconds():g} s"))
        self.check()

    def abort(self, exc: BaseException) -> None:
        self.fail(exc)
        while not self.queue.empty():  # unsent chunks are dropped
            self.queue.get_nowait()
        if self.thread.is_alive():
            self.queue.put(exc)
            self.thread.join()
        self.watcher.join(self.timeout.total_seconds())


class _Destination(_Side):
    def __init__(self, col: Collector, pg: Any, rank: int, peers: list[int], chunk_bytes: int) -> None:
        super().__init__(chunk_bytes, col.max_pending)
        _return_freed_memory()
        self.col, self.rank, self.start = col, rank, time.perf_counter()
        self.channels = {p: Channel(pg, p, col.timeout) for p in peers}
        self.answered: set[int] = set()
        self.lost: set[int] = set()
        self.local_ended = False
        self.received = dict.fromkeys(sorted([rank, *peers]), 0)
        self.received_bytes = dict.fromkeys(sorted([rank, *peers]), 0)
        self.duplicates = 0
        # Peak on rank dst, in chunks c: one payload per receiver (W - 1) + the inbox (max_pending)
        # + the buffer (spill + c) + the merge's copy of split files (spill + c). With the default
        # c = budget / (8 (W + 1)) that is at most budget / 4 + 0.7 budget.
        self.spill_bytes = max(chunk_bytes, col.memory_budget * 35 // 100)
        try:
            self.writer = DatasetWriter(col.path, overwrite=col.overwrite, max_shard_bytes=col.max_shard_bytes)
        except BaseException as e:
            self._answer_all(Kind.ERROR, error_header(e))
            raise
        self._answer_all(Kind.DONE, {"frames": 0}, final=False)  # 1. ready
        enabled = col.progress if col.progress is not None else sys.stderr.isatty()
        self.bar = tqdm(desc="tdgather", unit=" frames", disable=not enabled, dynamic_ncols=True, file=sys.stderr)
        self.receivers = [
            threading.Thread(target=self._receive_loop, args=(p,), name=f"tdgather-recv-{p}", daemon=True)
            for p in peers
        ]
        self.writer_thread = threading.Thread(target=self._write_loop, name="tdgather-write", daemon=True)
        for t in [*self.receivers, self.writer_thread]:
            t.start()

    def _maybe_flush(self) -> None:
        if self.store.nbytes >= self.chunk_bytes:
            self.put(("local", self.rank, self.store))
            self.store = FrameStore()

    def _receive_loop(self, peer: int) -> None:
        ch, frames, end = self.channels[peer], 0, None
        try:
            while True:
                msg = ch.recv()
                if msg.kind == Kind.ERROR:
                    raise PeerError(peer, msg.header["type"], msg.header["message"])
                if msg.kind == Kind.DONE:
                    if msg.header["frames"] != frames:
                        raise ProtocolError(peer, "done.frames", f"expected {frames}, got {msg.header['frames']}")
                    break
                if msg.header.parts:
                    frames += msg.header.num_frames
                    if self.failure is None:  # after a failure, drain and drop
                        self.queue.put(("parts", peer, unpack(msg.header, msg.payload, peer)))
        except BaseException as e:
            end = e
            if isinstance(e, PeerLostError):
                self.lost.add(peer)
        self.queue.put(("end", peer, end))  # the writer consumes until every source has ended

    def _write_loop(self) -> None:
        buffered, nbytes, open_sources = [], 0, {*self.channels, self.rank}
        while open_sources:
            kind, src, item = self.queue.get()
            if kind == "end":
                open_sources.discard(src)
                if item is not None:
                    self._fail(item)
                continue
            try:
                parts = local_parts(item, src) if kind == "local" else item
                frames = sum(p.frame_idx.numel() for p in parts)
                size = sum(p.frame_idx.numel() * p.layout.frame_nbytes for p in parts)
                self.received[src] += frames
                self.received_bytes[src] += size
                self._progress(frames)
                if self.failure is not None:
                    continue
                buffered += parts
                nbytes += size
                if nbytes >= self.spill_bytes:
                    self._spill(buffered)
                    buffered, nbytes = [], 0
            except BaseException as e:
                self._fail(e)
        if self.failure is None and buffered:
            try:
                self._spill(buffered)
            except BaseException as e:
                self._fail(e)

    def _spill(self, parts: list) -> None:
        merged, dropped = merge(parts)
        self.duplicates += dropped
        self.writer.write(merged)

    def _progress(self, frames: int) -> None:
        if self.bar.disable:
            return
        ranks = self.received_bytes.items()
        per_rank = " ".join(f"r{r}:{self.received[r]}/{b / 1e6:.0f}MB" for r, b in ranks) if len(ranks) <= 8 else ""
        total = sum(self.received_bytes.values()) / 1e6
        self.bar.set_postfix_str(f"{total:.0f} MB, {len(self.writer.shards)} shards {per_rank}", refresh=False)
        self.bar.update(frames)

    def _fail(self, e: BaseException) -> None:
        if self.fail(e):
            self._answer_all(Kind.ERROR, error_header(e))  # every sender learns at once

    def _answer_all(self, kind: Kind, header: dict, final: bool = True) -> None:
        for peer, ch in self.channels.items():
            with self.lock:
                if peer in self.lost or (final and peer in self.answered):
                    continue
                if final:
                    self.answered.add(peer)
            try:
                ch.wait(ch.send(kind, header), "answering the peer")
            except Exception:  # unreachable: never let this stop the writer, which must drain
                self.lost.add(peer)

    def close(self) -> CollectorSummary:
        self.check()
        closing = time.perf_counter()
        if len(self.store):
            self.put(("local", self.rank, self.store))
        self._end_local()
        self.writer_thread.join()
        for t in self.receivers:
            t.join()
        self.bar.close()
        self.check()
        self.writer.commit({"duplicates_dropped": self.duplicates + self.writer.duplicates_dropped})
        self._answer_all(Kind.DONE, {"frames": self.writer.frames})
        end = time.perf_counter()
        summary = CollectorSummary(
            path=str(self.col.path),
            frames=self.writer.frames,
            bytes=self.writer.nbytes,
            duplicates_dropped=self.duplicates + self.writer.duplicates_dropped,
            frames_per_rank=dict(self.received),
            shards=len(self.writer.shards),
            seconds=end - self.start,
            close_seconds=end - closing,
        )
        if self.col.log_summary:
            log.info("%s", summary)
        return summary

    def _end_local(self) -> None:
        if not self.local_ended:
            self.local_ended = True
            self.queue.put(("end", self.rank, None))

    def abort(self, exc: BaseException) -> None:
        self._fail(exc)
        self._end_local()
        self.writer_thread.join()
        for t in self.receivers:
            t.join()
        self.bar.close()
        self.writer.abort()
