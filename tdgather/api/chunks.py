"""`Chunks`: the frames one rank's loop adds, cut into chunks on a bounded queue, with back-pressure.

Every rank has one. A sender's queue is its stream's (`tdgather.api.sending.Link`), whose send
thread packs and sends each chunk; a writer's is its own inbox (`tdgather.api.destination`), beside
its peers' chunks. A full queue makes ``add`` wait: the loop runs at most ``max_pending`` chunks
ahead of what is sent or written.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..core.framestore import FrameStore
from ..storage.saved import Saved
from .failure import Failure
from .liveness import Progress
from .settings import Settings

__all__ = ["Chunks"]

_CHUNK_BYTES_PER_FILE = 512  # a filename in a chunk: in the store, the wire header, rank dst's parsed copy


class Chunks:
    """The loop's frames: the current chunk (a `FrameStore`) and the queue the full ones go on.

    1. ``add`` / ``update`` from the loop (raising the rank's failure, if any): into the current
       chunk, which goes on ``out`` once full or old (``put``);
    2. ``put(item)``: onto ``out``, waiting while it is full, not past the rank's failure;
    3. at close ``flush()``, at abort ``take()``: the frames it holds.

    ``saved`` is what a resumed run saved: each chunk is seeded with its layouts. ``source``: a
    writer's own rank, whose chunks go into its inbox as ``("local", source, store)``; a sender's go
    as the store alone. ``arenas``: a sender whose writer shares its host (`tdgather.comm.shm.ShmWriter.arena`):
    each chunk copies its batches into the shared memory it is sent in.
    """

    def __init__(
        self,
        settings: Settings,
        saved: Saved,
        failure: Failure,
        progress: Progress,
        out: queue.Queue,
        source: int | None = None,
        arenas: Callable[[int], Any] | None = None,
    ) -> None:
        self.settings, self.saved, self.failure, self.progress = settings, saved, failure, progress
        self.out, self.source = out, source
        self.arenas = arenas if settings.copy else None  # a sender on rank dst's host: `tdgather.comm.arena.Arena`
        self.store = self._new_store()
        self.since: float | None = None  # when the current chunk's first frame came
        self.pending_peak = 0  # the most chunks queued at once

    def add(self, filenames: Any, frame_idx: Any, frames: Any, ragged: Any = ()) -> None:
        """`FrameStore.add` into the current chunk."""
        self.failure.check()
        self.store.add(filenames, frame_idx, frames, ragged=ragged)
        self._maybe_flush()

    def update(self, predictions: Mapping[str, Any], ragged: Any = ()) -> None:
        """`FrameStore.update` into the current chunk."""
        self.failure.check()
        self.store.update(predictions, ragged=ragged)
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        """Queue the chunk once its frames, and what its filenames cost beside them, reach ``chunk_bytes``.

        Or once its first frame is ``flush_every`` seconds old: a slow loop with small outputs sends
        (and rank dst writes) them in time, not only at close (`Settings.commit_every`).
        """
        now = time.monotonic()
        if self.since is None:
            self.since = now
        full = self.store.nbytes + _CHUNK_BYTES_PER_FILE * len(self.store.names) >= self.settings.chunk_bytes
        if full or (len(self.store) and now - self.since >= self.settings.flush_every):
            self.put(self._item(self.store))  # kept until queued: an abort sends what a failed put did not
            self.store = self._new_store()
            self.since = None

    def put(self, item: Any) -> None:
        """From the loop's thread: queue an item, waiting while the queue is full, not past a failure."""
        with self.progress.waiting():
            while True:
                try:
                    self.out.put(item, timeout=0.05)
                    break
                except queue.Full:
                    if self.failure.error is not None:
                        raise self.failure.error from None
        self.pending_peak = max(self.pending_peak, self.out.qsize())

    def flush(self) -> None:
        """At close: queue the frames it holds (as ``put``)."""
        if len(self.store):
            self.put(self._item(self.store))

    def take(self) -> Any:
        """At abort: the frames it holds, as a queue item (None when it holds none); a new chunk starts."""
        store, self.store = self.store, self._new_store()
        return self._item(store) if len(store) else None

    def _item(self, store: FrameStore) -> Any:
        return store if self.source is None else ("local", self.source, store)

    def _new_store(self) -> FrameStore:
        """A chunk's store; with ``arenas``, its copied batches go straight into an shm file of twice the chunk.

        A chunk is sent once it reaches ``chunk_bytes``, so it holds less than that plus its last batch.
        """
        arena = self.arenas(2 * self.settings.chunk_bytes) if self.arenas is not None else None
        return FrameStore(self.settings.copy, self.saved.layouts, self.settings.fixed, arena=arena)
