"""`Collector`: gather while the inference loop runs, with bounded memory on rank ``dst``.

Call order, on every rank of the group:

1. ``open()`` (entering the ``with`` block): every rank agrees on the call (call number,
   dst, path: `tdgather.comm.transport.begin_call`); rank ``dst`` checks the output directory and
   answers every peer ``done`` (ready) or ``error``. Nothing is sent before that.
2. ``add()`` / ``update()`` in the loop: frames go into a `FrameStore`. Every
   ``chunk_bytes`` the chunk is handed to a background thread, which packs and sends it.
   A sender holds at most ``max_pending`` unsent chunks: a full queue makes ``add()`` wait.
   An idle sender sends an empty ``data`` message every ``timeout / 4``, so that rank
   ``dst`` can tell a slow rank from a stopped one.
3. Rank ``dst`` receives every peer on its own thread. A writer thread buffers the parts
   and, when the buffer passes its share of ``memory_budget``, merges it (lowest rank first,
   duplicates by the policy) and commits shards (`DatasetWriter`). A filename may so span
   several shards, as segments. Until it answers, rank ``dst`` sends every peer a heartbeat.
4. ``close()`` (leaving the block): senders flush, send ``done`` and wait for rank ``dst``'s
   answer for as long as it sends heartbeats (ranks may finish hours apart); rank ``dst``
   writes the last shard and the index, answers each peer, and returns a `CollectorSummary`.

On an error anywhere (an exception in the block, a failed or lost peer, Ctrl-C, or SIGTERM as
SLURM, Kubernetes and torchrun send it: `tdgather.api.terminate`), every rank raises within the
timeout. Rank ``dst`` answers ``error`` to every peer at once, writes everything
that reached it (until each peer's stream ends) to ``<path>.partial`` (under a URL: beside any
old dataset, under names of its own), lists it there in ``tdgather.incomplete.json`` (read with
``tdgather.open(path, incomplete=True)``), and writes no index.

With ``ranks_per_writer=k`` every block of k ranks has its own writer, its first rank, which
plays rank ``dst``'s part for its block and, at close, reports its shards to rank ``dst``, which
writes one index over all of them (`tdgather.format.blocks`).

Which role each rank plays is `tdgather.api.roles.role`; what each role does at open, close and
abort, `tdgather.api.choreography`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..comm.groups import as_timeout, resolve_dst, transport_group
from ..comm.transport import Call, begin_call
from ..core.duplicates import DuplicatePolicy
from ..storage.location import is_url, local_path, store_at
from ..storage.saved import Saved
from ..storage.sink import SinkFactory
from ..storage.writer import DEFAULT_SHARD_BYTES
from .choreography import Rank, abort_rank, close_rank, open_rank
from .liveness import Progress, Watchdog
from .reporting import visible
from .roles import role
from .settings import CollectorStatus, CollectorSummary, Settings, default_write_threads
from .terminate import SigtermAsExit

__all__ = ["Collector", "CollectorStatus", "CollectorSummary"]

log = logging.getLogger("tdgather")


class Collector:
    """Stream every rank's frames to rank ``dst`` during the loop; rank ``dst`` writes the dataset.

    Example:
        >>> with tdgather.Collector("out/epoch_3") as col:  # doctest: +SKIP
        ...     for batch in loader:
        ...         col.add(batch["filename"], batch["frame_idx"], model(batch["video"].cuda()))

    Args:
        path: the dataset directory, or an object store URL (``s3://bucket/prefix``: see
            ``storage_options``); used on rank ``dst`` (and each writer); `tdgather.save` has the layout.
        dst: the global rank that receives and writes (as in ``torch.distributed``); with neither
            ``dst`` nor ``group_dst``, global rank 0.
        group: the process group (default: the world); NCCL groups get a side gloo group.
        group_dst: instead of ``dst``, the receiving rank's rank within ``group``.
        timeout: seconds of silence from another rank, or without a call into this Collector from
            this rank's loop (`tdgather.api.liveness`), that count as a failure; default 30 minutes.
            Busy ranks send heartbeats, so ranks may finish far apart; set it above the slowest batch.
        overwrite: replace an existing tdgather dataset (or a failed run's leftovers), atomically,
            when the new one is complete; any other non-empty directory is refused.
        duplicates: copies of one ``(filename, frame_idx)``: ``"keep"`` one (the default),
            ``"exact"``, or ``DuplicatePolicy("close", rtol=..., atol=...)``; see `tdgather.api.gather`.
        copy: copy CPU frames given to ``add`` (default), so the loop may reuse its buffers; with
            False they are sent from the caller's tensors, which must then not change.
        memory_budget: bytes rank ``dst`` may hold above its baseline (default 1 GiB).
        chunk_bytes: a sender sends its frames every this many bytes (default from the budget).
        max_pending: unsent chunks a rank may hold before ``add()`` waits.
        max_shard_bytes: the largest shard rank ``dst`` writes.
        progress: on rank ``dst``, None (default): a progress bar when stderr is a terminal, else (a
            batch job's log) a line every minute on the ``"tdgather"`` logger, shown with no logging
            setup (`tdgather.api.reporting`); True: the bar; False: neither.
        log_summary: log the summary (logger ``"tdgather"``) when closing; default: unless
            ``progress=False``.
        commit_every: seconds; rank ``dst`` writes what it holds as shards at least this often, and
            senders send what they hold at least every ``min(commit_every / 4, 30)`` seconds (at their
            next ``add``), so a rank dst that is killed loses at most about this much of a slow job
            with small outputs (default 300: 5 minutes, about 12 shards an hour at most).
        metadata: your JSON values (numpy scalars are converted), stored in the index as
            ``metadata["user"]``, beside tdgather's own keys, which never replace yours. Rank
            ``dst``'s is the one stored; it checks it when the Collector opens, and a value JSON
            cannot hold fails every rank there, naming its key.
        storage_options: for an object store URL (``s3://``, ``gs://``, ``az://``, any fsspec URL),
            the filesystem's options, as fsspec, pandas and datasets take them (credentials, an
            ``endpoint_url``...); see docs/object-storage.md. Not for a local path.
        ragged: None (default): a leaf whose first dim changes between frames of a filename (boxes
            ``[N_i, 4]``) is made ragged where that is found, on any rank, before or after frames
            were written; False: every leaf is fixed, and such a change is a `ShapeMismatchError`.
            (``add(..., ragged=[...])`` names leaves ragged from their first frame.)
        resume: continue a run that failed (or finished): keep what ``<path>.partial`` (or ``path``;
            under a URL, the failed run's objects or the dataset there) holds, give every rank ``saved``
            to skip it, drop frames sent again by the duplicates policy, and record each attempt in the
            index. Nothing saved: a fresh run.
        append: add this job's frames to the dataset at ``path`` (created if absent) as its next
            snapshot, beside other jobs' (a SLURM array's tasks, plain processes), each frame kept
            once: a copy of a frame the dataset holds is resolved by ``duplicates`` at the commit, as
            copies within the job are (docs/many-jobs.md). Not with ``overwrite``. With ``resume``,
            a job run again continues its run: the shards its earlier attempts wrote are ``saved``,
            found by the job's key (``TDGATHER_JOB``, or the scheduler's id; `tdgather.storage.jobmark`).
        ranks_per_writer: one writer per block of this many consecutive ranks (a node: torchrun's
            ``LOCAL_WORLD_SIZE``), instead of rank ``dst`` alone. Each block's first rank receives its
            block's frames and writes them as shards of its own into ``<path>.partial``, which every
            writer must see (a shared filesystem), or straight to the object store at ``path`` (a
            URL: nothing shared is needed); at close rank ``dst`` (a writer: a multiple of
            this) writes one index over all of them. See `tdgather.storage.combine`.
        write_threads: shards rank ``dst`` (and each writer) writes at once, each on a thread of its
            own, for a disk that takes more than one core can write. Default: a quarter of this
            process's cores, from 1 to 4, for a local path; 1 for an object store URL; at most 64.
            Each shard being written holds its share of ``memory_budget``, so shards get smaller as
            it grows, down to one chunk (or one frame, where a frame is larger): with frames larger
            than that share, rank ``dst`` may hold up to this many shards more than with one thread.
        sink: makes the `tdgather.storage.sink.Sink` that writes, on rank dst and on each writer; it
            is called with `tdgather.storage.writer.DatasetWriter`'s keywords. Default: that class, on
            the local filesystem. Tests pass one that counts, slows or fails a step.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        dst: int | None = None,
        group: Any = None,
        group_dst: int | None = None,
        timeout: float | timedelta | None = None,
        overwrite: bool = False,
        duplicates: str | DuplicatePolicy = "keep",
        copy: bool = True,
        memory_budget: int = 1 << 30,
        chunk_bytes: int | None = None,
        max_pending: int = 2,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        progress: bool | None = None,
        log_summary: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
        resume: bool = False,
        ranks_per_writer: int | None = None,
        sink: SinkFactory | None = None,
        storage_options: dict | None = None,
        ragged: bool | None = None,
        commit_every: float = 300.0,
        append: bool = False,
        write_threads: int | None = None,
    ) -> None:
        for name, value, low in (("memory_budget", memory_budget, 1), ("max_pending", max_pending, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        if isinstance(commit_every, bool) or not isinstance(commit_every, int | float) or not commit_every > 0:
            raise ValueError(f"commit_every: expected a number of seconds > 0, got {commit_every!r}")
        if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes < 1):
            expected = "None (derived from the budget) or an integer >= 1"
            raise ValueError(f"chunk_bytes: expected {expected}, got {chunk_bytes!r}")
        if dst is not None and group_dst is not None:
            resolve_dst(None, dst, group_dst)  # raises: only one of them
        if storage_options is not None and not is_url(path):
            store_at(path, storage_options)  # raises: options for a local path
        # a file:// URL is the local path it names, as tdgather.open reads it (`tdgather.storage.location`)
        self.path, self.group = (path.rstrip("/") if is_url(path) else local_path(path)), group
        self.storage_options = storage_options
        self._dst_args = (dst, group_dst)
        self.dst = 0  # the receiving rank within the group, known once open
        self.timeout = as_timeout(timeout)
        self.overwrite, self.memory_budget, self.max_pending = overwrite, memory_budget, max_pending
        self.resume, self.append = resume, append
        self.metadata = metadata  # rank dst checks it at open (`user_metadata`) and stores it
        self.max_shard_bytes, self.progress = max_shard_bytes, progress
        self.log_summary = log_summary if log_summary is not None else progress is not False
        self.commit_every = float(commit_every)
        self.duplicates, self.copy = DuplicatePolicy.of(duplicates), copy
        if write_threads is not None and (type(write_threads) is not int or not 1 <= write_threads <= 64):
            raise ValueError(f"write_threads: expected None or an integer from 1 to 64, got {write_threads!r}")
        self.write_threads = write_threads
        if ranks_per_writer is not None and (type(ranks_per_writer) is not int or ranks_per_writer < 1):
            raise ValueError(f"ranks_per_writer: expected None or an integer >= 1, got {ranks_per_writer!r}")
        self.ranks_per_writer = ranks_per_writer
        self.sink = sink
        if ragged not in (None, False):
            raise ValueError(
                f"ragged: expected None (leaves made ragged where found) or False (all fixed), got {ragged!r}"
            )
        self.fixed = ragged is False
        self._chunk_bytes = chunk_bytes
        self._rank: Rank | None = None  # this rank's components, while open
        self._progress = Progress()  # the loop's calls into tdgather (`tdgather.api.liveness`), new at each open
        self._call: Call | None = None
        self._saved: Saved | None = None
        self._sigterm = SigtermAsExit()
        self._watchdog: Watchdog | None = None
        self.summary: CollectorSummary | None = None  # set by close() on rank dst

    def open(self) -> Collector:
        """Start collecting (what entering the ``with`` block does). Called by every rank.

        1. every rank: its role, from its rank, the group's size, rank dst and ``ranks_per_writer``;
        2. every rank agrees on the call: its number, dst, kind (with k) and path (`begin_call`);
        3. its components open: a sender waits for its writer's ready answer, a writer checks the output
           and answers its peers (`tdgather.api.choreography.open_rank`);
        4. SIGTERM now keeps what this rank holds, as Ctrl-C does; the watchdog starts.
        """
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1
        pg = transport_group(self.group) if distributed else None
        rank, world = (dist.get_rank(pg), dist.get_world_size(pg)) if distributed else (0, 1)
        self.dst = resolve_dst(self.group, *self._dst_args) if distributed else 0
        me = role(rank, world, self.dst, self.ranks_per_writer)  # 1.
        chunk = self._chunk_bytes or min(64 << 20, max(256 << 10, self.memory_budget // (8 * (world + 1))))
        settings = Settings(
            path=self.path,
            timeout=self.timeout,
            overwrite=self.overwrite,
            duplicates=self.duplicates,
            copy=self.copy,
            memory_budget=self.memory_budget,
            chunk_bytes=chunk,
            max_pending=self.max_pending,
            max_shard_bytes=self.max_shard_bytes,
            progress=self.progress,
            metadata=self.metadata,
            resume=self.resume,
            append=self.append,
            sink=self.sink,
            storage_options=self.storage_options,
            fixed=self.fixed,
            commit_every=self.commit_every,
            write_threads=self.write_threads or default_write_threads(self.path),
        )
        self._progress = Progress()
        if distributed:  # 2.
            k = me.ranks_per_writer  # every rank must agree on it
            kind = "Collector" if k is None else f"Collector(ranks_per_writer={k})"
            self._call = begin_call(pg, kind, self.dst, self.timeout, str(self.path))
        try:
            self._rank = open_rank(me, settings, self._call, rank, self._progress)  # 3.
        except BaseException:
            self._end_call()
            raise
        self._saved = self._rank.saved
        self._sigterm.install()  # 4.
        if distributed:  # liveness is the loop's progress, not a live thread (`tdgather.api.liveness`)
            stall = self._rank.stall
            self._watchdog = Watchdog(self._progress, self.timeout.total_seconds(), dist.get_rank(), stall).start()
        return self

    def status(self) -> CollectorStatus:
        """A snapshot of this rank's progress: frames received and shards written (rank dst), or back-pressure.

        A call is progress (`tdgather.api.liveness`), as ``add`` is.
        """
        return self._active("status()").status()

    @property
    def saved(self) -> Saved:
        """What earlier attempts of a resumed run saved (`tdgather.Saved`), the same on every rank.

        Empty for a fresh run. Skip it when building the loader: ``col.saved.todo(samples, key=...)``.
        """
        if self._saved is None:
            raise RuntimeError("Collector is not open: `saved` is known once it opens (the `with` line)")
        return self._saved

    def add(self, filenames: str | Sequence[str], frame_idx: Any, frames: Any, *, ragged: Any = ()) -> None:
        """Add a batch of B frames (as `FrameStore.add`); returns quickly, waits only on back-pressure.

        ``ragged=False`` is for the whole run: pass it to the Collector (every rank and rank dst then hold to it).
        """
        self._check_fixed(ragged)
        self._active("add()").chunks.add(filenames, frame_idx, frames, ragged=ragged)

    def _check_fixed(self, ragged: Any) -> None:
        if ragged is False and not self.fixed:
            raise ValueError(
                "add(ragged=False): every leaf fixed is declared for the whole run, so that rank dst refuses a first "
                "dim that changes across ranks and chunks too: pass Collector(path, ragged=False) instead"
            )

    def update(self, predictions: Mapping[str, Any], *, ragged: Any = ()) -> None:
        """Add ``{filename: (frame_idx, value)}`` or a list of such pairs per filename (as `FrameStore.update`)."""
        self._check_fixed(ragged)
        self._active("update()").chunks.update(predictions, ragged=ragged)

    def close(self) -> CollectorSummary | None:
        """Flush and finish; on rank ``dst`` write the index and return the summary, elsewhere None."""
        rank, self._rank = self._active(), None
        try:
            with self._progress.waiting():
                try:
                    summary = close_rank(rank)
                except BaseException as e:
                    self._sigterm.hold()  # torchrun's SIGTERM (a peer died) must not cut the abort short
                    abort_rank(rank, e)
                    raise
        finally:
            self._end_call()
        if summary is not None:
            self.summary = summary
            if self.log_summary:
                visible()  # a job's log shows it with no logging setup
                log.info("%s", self.summary)
        return self.summary

    def abort(self, exc: BaseException) -> None:
        """Stop because of ``exc``: tell every rank; rank dst keeps what reached it, and writes no index."""
        rank, self._rank = self._rank, None
        self._sigterm.hold()  # torchrun's SIGTERM (a peer died) must not cut the abort short
        try:
            if rank is not None:
                with self._progress.waiting():
                    abort_rank(rank, exc)
        finally:
            self._end_call()

    def _end_call(self) -> None:
        self._sigterm.remove()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._call is not None:
            self._call.end()
            self._call = None

    def __enter__(self) -> Collector:
        return self.open()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
        else:
            self.abort(exc)

    def _active(self, call: str | None = None) -> Rank:
        """This rank's open components; ``call`` (``"add()"``) is the loop's progress (`tdgather.api.liveness`)."""
        if self._rank is None:
            raise RuntimeError("Collector is not open: use it as `with Collector(...) as col:` or call open()")
        if call is not None:
            self._progress.touch(call)
        return self._rank
