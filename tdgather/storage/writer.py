"""Stage 5, `DatasetWriter`: the filesystem `Sink`, sharded safetensors plus a JSON index, atomic and durable.

Layout of a dataset directory (docs/format.md has it whole, for readers with safetensors alone)::

    out/epoch_3/
        shard-00000.safetensors       # valid safetensors: readable with safetensors alone
        shard-00001.safetensors
        tdgather.index.json           # written last: its presence means "complete"

A shard holds the frames of each filename, grouped by layout (`tdgather.storage.shards` has its
tensors). The index maps each filename to its segments (shard, group, first row, frame count), so
reading one filename reads only its rows. A one-shot `save` gives each filename one segment; a
streaming `tdgather.Collector` may give it one per shard it wrote while frames arrived, and frames
written before are compared with their copies on disk (`tdgather.storage.ondisk`).

Where the files go, and how the dataset is committed, is the output's (`output_at`): a local
directory (`tdgather.storage.local`: staged in ``<name>.partial``, each file renamed into place,
the index last, then the directory moved into place) or an object store prefix
(`tdgather.storage.prefix`: shards written in place under names of their own, the index last, in
one PUT). Every shard is listed in the index with its size, and its checksum: in a local directory its
CRC-32, computed as it is written; in an object store its sha256.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ..core.duplicates import DuplicateCounts, DuplicatePolicy
from ..core.frames import Frames, Layout
from ..core.gcpause import collection_paused
from ..core.plan import Mismatches
from ..core.promote import schema
from ..errors import FrameConflictError, OutputError
from ..format.codec import encode
from ..format.names import (
    FORMAT,
    INCOMPLETE_NAME,
    SCHEMA_VERSION,
    index_version,
    next_number,
    shard_name,
)
from ..format.records import Attempt, Failure, IndexMeta, ShardRecord
from .append import AppendOutput
from .atomic import LocalFS
from .catalog import Catalog
from .ondisk import compare_written, drop_written
from .output import Output, output_at
from .runstate import RunState
from .scan import from_shards
from .shardrecord import read_record
from .shards import Item, Slice, fill, items_of, record_shard, shard_tensors, shard_totals, whole_files
from .store import Store, digest

__all__ = ["DEFAULT_SHARD_BYTES", "DatasetWriter"]

DEFAULT_SHARD_BYTES = 1 << 30


class DatasetWriter:
    """Writes a dataset incrementally: shards as they fill, the index last.

    Call order (rank ``dst`` only):

    1. ``DatasetWriter(path, ...)`` checks the output (`output_at`: a local directory, staged in
       ``<path>.partial``, or an object store URL with ``storage_options``);
    2. ``write(frames)`` any number of times: each call writes one or more shards (their fsync and
       rename into place run on a background thread, overlapping what comes next; with
       ``write_threads`` > 1, that many shards are written at once, each whole on a thread of its
       own, and ``wait_written()`` waits for them, so the buffers they are written from may be
       reused; a write that failed raises at the next ``write`` or at ``commit``). A filename
       may appear in several calls; its frames then form several segments, and a frame already
       written is compared with its copy on disk and resolved by the duplicates policy (the
       copy on disk stays; the new one is dropped and counted, or refused). Its segments may
       differ in a leaf's first dim, or in whether the leaf is ragged: the leaf then reads as
       ragged (`tdgather.core.promote`); not with ``fixed``;
    3. ``commit()`` waits until every shard is durable, writes the index and puts the dataset in
       place; or ``abort()``, which keeps the committed shards and writes no index, only (given
       the failure) ``tdgather.incomplete.json``, which lists them; or ``discard()``, which removes
       them. Each is the output's step (``self.out``, a `tdgather.storage.output.Output`).

    With several writers (`tdgather.format.blocks`, `tdgather.storage.combine`), ``writer`` numbers
    this writer's shards; the coordinator's writer calls ``combine`` with the others' reports before
    ``commit``. Another writer ``joins`` a run (the run id and attempt the coordinator gave): it writes
    into the coordinator's output without checking or locking it, its ``commit`` writes no index
    (``report`` lists its shards), and its ``abort`` writes no record (the coordinator does).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        overwrite: bool = False,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        duplicates: str | DuplicatePolicy = "keep",
        resume: bool = False,
        writer: int | None = None,
        joins: tuple[str, int] | None = None,
        fs: LocalFS | None = None,
        storage_options: dict | None = None,
        store: Store | None = None,
        fixed: bool = False,
        append: bool = False,
        output: Output | None = None,
        write_threads: int = 1,
    ) -> None:
        # where the files go, and how they are committed (append: as a new snapshot, beside other jobs');
        # ``output``: an `Output` made by the caller (a compaction's, `tdgather.storage.compact`)
        self.out = output or output_at(path, storage_options, fs, store, append)
        self.set_policy(DuplicatePolicy.of(duplicates))
        self.fixed = fixed  # frames declared fixed (ragged=False): a filename's first dims may not change
        self.max_shard_bytes = max_shard_bytes
        self.writer, self.joins = writer, joins
        if joins is not None:  # one writer's shards of a dataset the coordinator opened (`tdgather.format.blocks`)
            existing = self.out.join()
            state = RunState(joins[0])
        else:
            state = self.out.open(overwrite, resume)
            existing = list(state.shards)
        self.target = self.out.target
        self.run, self.attempts, self.attempt = state.run, state.attempts, joins[1] if joins else state.attempt
        self.saved = state.to_saved()  # what earlier attempts saved, as every rank gets it
        self.shards: dict[str, dict] = state.shards
        try:
            self._digest_saved()
        except BaseException:
            self.out.close()  # the local output's lock
            raise
        self.catalog = Catalog()  # per filename: layout, frames written (as runs), segments, senders
        self.catalog.load(state.files, state.layouts, state.written)
        self._saved_frames = self.frames
        self._tag = (self.run, self.attempt) if self.out.tag else None  # object stores: names of this attempt's own
        self._next_shard = 0 if self._tag else next_number(existing, writer)
        self.duplicates = DuplicateCounts()  # copies dropped against frames already on disk
        self._syncer: ThreadPoolExecutor | None = None  # makes shards durable while the next is written
        self._syncing: list[tuple[str, Future]] = []
        # write_threads > 1: that many shards are written at once, each on a thread of its own (written,
        # fsynced, renamed); the caller gets on with the next while they are
        self.write_threads = write_threads
        self._putter: ThreadPoolExecutor | None = None
        self._writing: list[tuple[str, Future]] = []  # shards handed to the write threads, in order
        self._failed: list[str] = []  # shards whose last step failed: never listed
        self._mine: list[str] = []  # the shards this attempt wrote

    def _digest_saved(self) -> None:
        """Size and checksum of each saved shard listed without (a killed attempt's; an older tdgather's).

        The checksum is the one this store's writes compute: sha256 in an object store, CRC-32 locally,
        where the failed attempt's record lists it for a shard of the size on disk, else read whole.
        """
        store = self.out.store
        recorded = _recorded_crc32(store, self.run) if store.checksum == "crc32" else {}
        for name, entry in self.shards.items():
            if store.checksum == "sha256" and "sha256" not in entry:
                got = digest(store, name)
                entry.update(size=got.size, sha256=got.sha256)
            elif store.checksum == "crc32" and "crc32" not in entry:
                size = store.size(name)
                if name in recorded and recorded[name][0] == size:
                    entry.update(size=size, crc32=recorded[name][1])
                else:  # a killed attempt's shard, or an older tdgather's
                    got = digest(store, name, sha256=False)
                    entry.update(size=got.size, crc32=got.crc32)
            elif "size" not in entry:
                entry["size"] = store.size(name)

    @property
    def snapshot(self) -> int | None:
        """The snapshot this run's commit wrote (``append=True``, once committed); None otherwise."""
        return getattr(self.out, "snapshot", None)

    @property
    def frames(self) -> int:
        """Frames committed so far."""
        return sum(s["frames"] for s in self.shards.values())

    @property
    def files(self) -> dict[str, dict]:
        """``{filename: {"frames", "segments"}}`` committed so far, as the index lists them (built on each call)."""
        return self.catalog.files()

    @property
    def nbytes(self) -> int:
        """Frame bytes committed so far."""
        return sum(s["bytes"] for s in self.shards.values())

    def write(
        self,
        frames: Mapping[str, Frames] | Any,
        ranks: Mapping[str, set[int]] | None = None,
        mismatches: Mismatches | None = None,
    ) -> list[str]:
        """Commit ``{filename: Frames}`` as new shards; return their names.

        Args:
            frames: the frames, one `Frames` per filename; or anything with ``groups`` (a
                `tdgather.Gathered`, a merge's result), whose columnar buffers are written as they are.
                A group's ``rank`` (one sender per row, as a merge gives) names each frame's sender in errors.
            ranks: for each filename, the ranks that sent these frames (named in conflict errors, where
                the frames carry no ``rank`` of their own and one rank sent them all).
            mismatches: go on past a filename written before with another layout: leave out its
                new frames and record the filename and its error here.

        Raises:
            ShapeMismatchError: a filename written before with another layout (without
                ``mismatches``); nothing of this call is written.
            DuplicateFrameError: a frame written before, which the policy refuses to see again.
        """
        with collection_paused():
            return self._write(frames, ranks or {}, mismatches)

    def _write(self, frames: Any, ranks: Mapping[str, set[int]], mismatches: Mismatches | None) -> list[str]:
        shards = whole_files(frames, ranks, self.catalog.ids.keys(), self.max_shard_bytes)  # the usual: columns
        if shards is None:
            shards = fill(self._drop_written(items_of(frames, ranks), mismatches), self.max_shard_bytes)
        return [self._write_shard(shard) for shard in shards]

    def _write_shard(self, shard: list[Item] | Slice) -> str:
        name_of_shard = shard_name(self.writer, self._next_shard, self._tag)
        self._next_shard += 1
        groups, entries, segments = shard_tensors(shard)
        names, frames, nbytes = shard_totals(shard)
        record = [[name, *s] for name, s in zip(names, segments, strict=True)]
        meta = ShardRecord(name_of_shard, groups, record, self.run, self.attempt).to_metadata()
        chunks = encode(entries, meta)
        entry = {"frames": frames, "bytes": nbytes, "groups": groups}
        if self.write_threads > 1:
            self._room_to_write()
            self._writing.append((name_of_shard, self._putter.submit(self.out.store.put, name_of_shard, chunks)))
        else:
            written = self.out.store.put(name_of_shard, chunks, then=self._in_background(name_of_shard))
            entry.update(written.entry())  # size (and sha256), listed in the index
        self._mine.append(name_of_shard)
        record_shard(self.catalog, name_of_shard, shard, segments)
        self.shards[name_of_shard] = entry
        return name_of_shard

    def _room_to_write(self) -> None:
        """Wait until fewer than ``write_threads`` shards are being written; raise the first write that failed."""
        if self._putter is None:
            self._putter = ThreadPoolExecutor(self.write_threads, thread_name_prefix="tdgather-write")
        busy = [future for _, future in self._writing if not future.done()]
        if len(busy) >= self.write_threads:
            wait(busy, return_when=FIRST_COMPLETED)
        error = self._take_written(block=False)
        if error is not None:
            raise error

    def wait_written(self) -> None:
        """Wait until every shard handed to a write thread is written (its buffers may then be reused).

        Raises:
            OutputError: the first write that failed (that shard is not listed).
        """
        error = self._take_written(block=True)
        if error is not None:
            raise error

    def _take_written(self, block: bool) -> BaseException | None:
        """The shards written on the write threads (all of them, waited for, with ``block``); the first failure.

        A shard written is listed with its size and checksum; one whose write failed is not listed.
        """
        first, still, failed = None, [], set()
        for name, future in self._writing:
            if not (block or future.done()):
                still.append((name, future))
                continue
            error = future.exception()
            if error is None:
                self.shards[name].update(future.result().entry())
            else:
                failed.add(name)
                first = first or error
        self._writing = still
        if failed:
            self._failed += sorted(failed)
            for name in failed:
                self.shards.pop(name, None)
            self.catalog.drop_shards(failed)
        return first

    def _drop_written(self, items: list[Item], mismatches: Mismatches | None) -> list[Item]:
        """Resolve frames already on disk by the policy: the disk copy stays, the new one goes.

        A filename written before with a layout that does not fit (`tdgather.core.promote.common_layout`)
        raises (or, with ``mismatches``, is recorded and left out). Every copy is compared in one pass
        (`tdgather.storage.ondisk`): each shard is opened once per window of rows, not once per filename.
        """
        kept, hits = drop_written(items, self.catalog, self.fixed, mismatches)
        if hits:
            self._settle()  # the shards read back must be in place
            for counts in compare_written(self.out.store, self.catalog, self.policy, items, hits):
                self.duplicates += counts
        return kept

    def report(self) -> dict[str, dict]:
        """A writer's report (`tdgather.format.blocks`): once its shards are durable, frames, bytes, size, checksums."""
        self._settle()
        return {name: {k: v for k, v in entry.items() if k != "groups"} for name, entry in self.shards.items()}

    def combine(self, reports: Mapping[int, Mapping[str, dict]]) -> DuplicateCounts:
        """The coordinator's step before ``commit``: take every writer's shards, as ``{writer: report}``.

        Each shard reported must be in the output (``<path>.partial``, or the object store prefix) as
        this rank sees it, at the size its writer wrote. Every shard's own record is read back (checked
        as `tdgather.open` checks a dataset), copies of one frame held by several writers are resolved
        by the policy, and the result is what ``commit`` lists. Returns the copies dropped.

        Raises:
            OutputError: a shard reported is missing or of another size (the output is not shared).
            DuplicateFrameError, ShapeMismatchError: copies the policy refuses; two layouts for a filename.
        """
        self._settle()
        store = self.out.store
        sums = {name: entry for name, entry in self.shards.items()}
        for writer, shards in reports.items():
            for name, entry in shards.items():
                size = store.size(name)
                if size != entry["size"]:
                    seen = "is missing" if size is None else f"has {size} bytes"
                    raise OutputError(
                        f"writer {writer} wrote {name} ({entry['size']} bytes) into {store.where!r}, which here "
                        f"{seen}: with ranks_per_writer, the output must be one every writer reaches (a shared "
                        "filesystem, or an object store URL)"
                    )
                sums[name] = entry
        names = sorted(sums)
        if not names:  # no writer had a frame: an empty dataset
            return DuplicateCounts()
        with collection_paused():
            if self._combine_new(sorted(set(sums) - set(self.shards)), sums):
                return DuplicateCounts()
            state = from_shards(store, names, policy=self.policy, frames=False, fixed=self.fixed)
        for name, entry in state.shards.items():
            entry.update(_as_written(sums[name]))
        self.shards, self.catalog = state.shards, Catalog()
        self.catalog.load(state.files, state.layouts, state.written)
        return state.duplicates

    def _combine_new(self, others: list[str], sums: Mapping[str, dict]) -> bool:
        """The usual combine: the other writers' shards (``others``) hold none of the filenames held here.

        Their records are read back column by column (`read_record`), checked, and added to what this
        writer holds; False (nothing taken) when a filename is in two writers' shards (or twice), or a
        shard is of another run: then every shard is read again and the copies resolved (`from_shards`).
        """
        records = [read_record(self.out.store, name) for name in others]
        filenames = [f for r in records for f in r.filenames]
        if any(r.run != self.run for r in records) or len(set(filenames)) != len(filenames):
            return False
        if not self.catalog.ids.keys().isdisjoint(filenames):
            return False
        for name, r in zip(others, records, strict=True):
            entry = {"frames": sum(r.rows.values()), "bytes": r.nbytes, "groups": r.groups}
            self.shards[name] = entry | _as_written(sums[name])
            self.catalog.extend(
                r.filenames,
                [r.layouts[g] for g in r.segment_groups],
                [name] * len(r.filenames),
                r.segment_groups,
                r.starts,
                r.frames,
            )
        return True

    def commit(self, metadata: Mapping[str, Any] | None = None) -> Path | str:
        """Write the index (last), then put the dataset in place; return its path (or URL).

        A writer that ``joins`` a run writes no index: it only waits until its shards are durable.
        """
        self._settle()
        if self.joins is not None:
            self.out.close()
            return self.out.store.where
        return self.out.commit(self._index(metadata), self.shards)

    def set_policy(self, policy: DuplicatePolicy) -> None:
        """The duplicates policy for the writes that follow, and (``append=True``) for the commit's.

        An append's commit resolves this job's copies of frames the dataset already holds by it too
        (`tdgather.storage.append.merge`), as copies within the run are.
        """
        self.policy = policy
        if isinstance(self.out, AppendOutput):
            self.out.policy = policy

    def discard(self) -> None:
        """Remove what this run wrote, unless it was committed; for a caller that still holds the frames (`save`)."""
        self._settle(raise_first=False)
        self.out.discard(self._mine)

    def abort(
        self, failure: BaseException | None = None, metadata: Mapping[str, Any] | None = None, rank: int | None = None
    ) -> Path | str:
        """Stop: the committed shards stay (in ``<path>.partial``, or under the prefix); return where.

        With ``failure``, an index of what was committed is written there as ``tdgather.incomplete.json``
        (never ``tdgather.index.json``), naming the failure, so ``tdgather.open(path, incomplete=True)``
        reads the frames saved before it. Its ``rank`` is the failure's own (a peer's error), else
        ``rank`` (the writer's, whose own code raised), and null for a conflict between ranks.
        """
        failed = self._settle(raise_first=False)
        for name in failed:  # a shard that never became durable is not listed
            self.shards.pop(name, None)
        self.catalog.drop_shards(set(failed))
        record = None
        if failure is not None and self.joins is None:  # a writer's failure goes to the coordinator, who records it
            who = getattr(failure, "rank", None)
            if who is None and not isinstance(failure, FrameConflictError):
                who = rank
            record = self._index(metadata, Failure(type(failure).__name__, str(failure), who))
        return self.out.abort(record)

    def _in_background(self, shard: str) -> Callable[[Callable[[], None]], None]:
        def submit(finish: Callable[[], None]) -> None:
            if self._syncer is None:
                self._syncer = ThreadPoolExecutor(1, thread_name_prefix="tdgather-fsync")
            self._syncing.append((shard, self._syncer.submit(finish)))

        return submit

    def _settle(self, raise_first: bool = True) -> list[str]:
        """Wait until every shard written is durable and in place; return the names of those that failed.

        Raises:
            OutputError: the first failure, with ``raise_first``.
        """
        first = self._take_written(block=True)
        if self._putter is not None:
            self._putter.shutdown()
            self._putter = None
        for name, future in self._syncing:
            error = future.exception()
            if error is not None:
                self._failed.append(name)
                first = first or error
        self._syncing.clear()
        if self._syncer is not None:
            self._syncer.shutdown()
            self._syncer = None
        if first is not None and raise_first:
            raise first
        return self._failed

    def _index(self, metadata: Mapping[str, Any] | None, failure: Failure | None = None) -> Iterator[bytes]:
        """The index's JSON, in pieces: ``files`` (last) is written from the catalog a few filenames at a time.

        ``metadata``: the caller's part of `IndexMeta` (``user``, duplicate counts, frames per rank).
        """
        this = Attempt(self.attempt, self.frames - self._saved_frames, failure)
        meta = IndexMeta(
            total_frames=self.frames,
            total_bytes=self.nbytes,
            num_filenames=self.catalog.num_files(),
            run=self.run,
            attempts=(*self.attempts, this),
            failure=failure,
            replaces=self.out.replaces,
            **(metadata or {}),
        )
        version = index_version(self.shards)
        index = {"format": FORMAT, "version": version, "metadata": meta.to_json(), "shards": self.shards}
        if version >= SCHEMA_VERSION:  # the frame types every group's frames read as, one per structure
            stored = {Layout.from_json(g) for entry in self.shards.values() for g in entry["groups"].values()}
            index["schema"] = [t.to_json() for t in schema(stored, fixed=self.fixed)]
        head = json.dumps(index, ensure_ascii=False, allow_nan=False)
        yield (head[:-1] + ', "files": ').encode()
        for piece in self.catalog.json_chunks():
            yield piece.encode()
        yield b"}"


def _as_written(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A shard's size and checksums, as its writer put it (a report's entry, or this writer's own)."""
    return {k: entry[k] for k in ("size", "sha256", "crc32") if k in entry}


def _recorded_crc32(store: Store, run: str) -> dict[str, tuple[int, int]]:
    """``{shard: (size, crc32)}`` as run ``run``'s last failed attempt recorded them; {} without such a record."""
    if store.size(INCOMPLETE_NAME) is None:
        return {}
    try:
        record = json.loads(store.read(INCOMPLETE_NAME))
    except (OSError, ValueError):  # unreadable: each shard is read whole instead
        return {}
    if not isinstance(record, dict) or not isinstance(record.get("metadata"), dict):
        return {}
    shards = record.get("shards")
    if record["metadata"].get("run") != run or not isinstance(shards, dict):
        return {}
    return {
        name: (e["size"], e["crc32"])
        for name, e in shards.items()
        if isinstance(e, dict) and type(e.get("size")) is int and type(e.get("crc32")) is int
    }
