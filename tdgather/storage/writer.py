"""Stage 5, `DatasetWriter`: the filesystem `Sink`, sharded safetensors plus a JSON index, atomic and durable.

Layout of a dataset directory (docs/format.md has it whole, for readers with safetensors alone)::

    out/epoch_3/
        shard-00000.safetensors       # valid safetensors: readable with safetensors alone
        shard-00001.safetensors
        tdgather.index.json           # written last: its presence means "complete"

In a shard, the frames of every filename of one layout ("group" ``g<k>``) are
stored back to back, filenames in sorted order: ``g<k>:frame_idx`` (int64
``[N]``), one tensor per leaf named by its path, ``g<k>.depth``, ``g<k>.det.boxes``
(``[N, ...]``; for a ragged leaf its values, ``[sum N_i, ...]``, with
``g<k>.det.boxes:offsets``, int64 ``[N+1]``: frame ``i``'s rows are
``offsets[i] : offsets[i+1]``), and for JSON leaves their UTF-8 JSON lines (uint8)
with ``:offsets`` (int64 ``[N+1]`` byte offsets); `tdgather.format.names` has the escaping
rule. The index maps each filename to its segments
(shard, group, first row, frame count), so reading one filename reads only its
rows. A one-shot `save` gives each filename one segment; a streaming
`tdgather.Collector` may give it one per shard it wrote while frames arrived.

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
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..core.duplicates import DuplicateCounts, DuplicatePolicy, compare, conflict
from ..core.frames import Frames, Layout, flatten
from ..core.gcpause import collection_paused
from ..core.plan import Mismatches
from ..core.promote import SAME_LAYOUT, common_layout, promote_columns, ragged_hint
from ..core.ragged import Ragged, joined, offsets_of
from ..core.runs import in_runs
from ..errors import FrameConflictError, OutputError, ShapeMismatchError
from ..format.limits import SHARD_HEADER_MAX, segment_record_bytes
from ..format.names import (
    FORMAT,
    INCOMPLETE_NAME,
    SHARD_VERSION,
    group_names,
    index_version,
    next_number,
    shard_name,
)
from ..format.records import Attempt, Failure, IndexMeta, ShardRecord
from .atomic import LocalFS
from .catalog import UNKNOWN, Catalog
from .encode import safetensors_chunks
from .local import LocalOutput
from .location import store_at
from .prefix import PrefixOutput
from .recovery import RunState, from_shards
from .segments import cat_columns, read_segment
from .store import Store

__all__ = ["DEFAULT_SHARD_BYTES", "DatasetWriter", "output_at"]

DEFAULT_SHARD_BYTES = 1 << 30


class DatasetWriter:
    """Writes a dataset incrementally: shards as they fill, the index last.

    Call order (rank ``dst`` only):

    1. ``DatasetWriter(path, ...)`` checks the output (`output_at`: a local directory, staged in
       ``<path>.partial``, or an object store URL with ``storage_options``);
    2. ``write(frames)`` any number of times: each call writes one or more shards (their fsync and
       rename into place run on a background thread, overlapping what comes next). A filename
       may appear in several calls; its frames then form several segments, and a frame already
       written is compared with its copy on disk and resolved by the duplicates policy (the
       copy on disk stays; the new one is dropped and counted, or refused). Its segments may
       differ in a leaf's first dim, or in whether the leaf is ragged: the leaf then reads as
       ragged (`tdgather.core.promote`); not with ``fixed``;
    3. ``commit()`` waits until every shard is durable, writes the index and puts the dataset in
       place; or ``abort()``, which keeps the committed shards and writes no index, only (given
       the failure) ``tdgather.incomplete.json``, which lists them.

    With several writers (`tdgather.format.parts`, `tdgather.storage.combine`), ``writer`` numbers
    this writer's shards; the coordinator's writer calls ``combine`` with the others' reports before
    ``commit``. Another writer is a ``part`` (the run id and attempt the coordinator gave): it writes
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
        part: tuple[str, int] | None = None,
        fs: LocalFS | None = None,
        storage_options: dict | None = None,
        store: Store | None = None,
        fixed: bool = False,
    ) -> None:
        self.out = output_at(path, storage_options, fs, store)  # where the files go, and how they are committed
        self.policy = DuplicatePolicy.of(duplicates)
        self.fixed = fixed  # frames declared fixed (ragged=False): a filename's first dims may not change
        self.max_shard_bytes = max_shard_bytes
        self.writer, self.part = writer, part
        if part is not None:  # one writer's part of a dataset the coordinator opened (`tdgather.format.parts`)
            existing = self.out.open_part()
            state = RunState(part[0])
        else:
            state = self.out.open(overwrite, resume)
            existing = list(state.shards)
        self.target = self.out.target
        self.run, self.attempts, self.attempt = state.run, state.attempts, part[1] if part else state.attempt
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
        self._failed: list[str] = []  # shards whose last step failed: never listed
        self._mine: list[str] = []  # the shards this attempt wrote

    def _digest_saved(self) -> None:
        """Size and checksum of each saved shard listed without (a killed attempt's; an older tdgather's).

        The checksum is the one this store's writes compute: sha256 in an object store, CRC-32 locally,
        where the failed attempt's record lists it for a shard of the size on disk, else read whole.
        """
        store = self.out.store
        recorded = _recorded_crc32(store, self.run) if store.local else {}
        for name, entry in self.shards.items():
            if not store.local and "sha256" not in entry:
                got = store.digest(name)
                entry.update(size=got.size, sha256=got.sha256)
            elif store.local and "crc32" not in entry:
                size = store.size(name)
                if name in recorded and recorded[name][0] == size:
                    entry.update(size=size, crc32=recorded[name][1])
                else:  # a killed attempt's shard, or an older tdgather's
                    got = store.digest(name, sha256=False)
                    entry.update(size=got.size, crc32=got.crc32)
            elif "size" not in entry:
                entry["size"] = store.size(name)

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
        shards: list[list[_Item]] = [[]]
        size = header = 0
        for item in self._drop_written(_items(frames, ranks), mismatches):
            nbytes = _frame_bytes(item.layout, item.idx, item.tensors) + 8 * item.idx.numel()
            record = segment_record_bytes(item.name)  # many long filenames: the header's limit comes first
            if shards[-1] and (size + nbytes > self.max_shard_bytes or header + record > SHARD_HEADER_MAX):
                shards.append([])
                size = header = 0
            shards[-1].append(item)
            size += nbytes
            header += record
        return [self._write_shard(shard) for shard in shards if shard]

    def _write_shard(self, shard: list[_Item]) -> str:
        name_of_shard = shard_name(self.writer, self._next_shard, self._tag)
        self._next_shard += 1
        groups, entries, segments = _shard_tensors(shard)
        record = [[item.name, *s] for item, s in zip(shard, segments, strict=True)]
        meta = ShardRecord(name_of_shard, groups, record, self.run, self.attempt).to_metadata()
        chunks = safetensors_chunks(entries, meta)
        written = self.out.store.put(name_of_shard, chunks, then=self._in_background(name_of_shard))
        self._mine.append(name_of_shard)
        for item, (group, start, frames) in zip(shard, segments, strict=True):
            segment = {"shard": name_of_shard, "group": group, "start": start, "frames": frames}
            self.catalog.add(item.name, item.layout, segment, item.idx, item.runs, item.rank)
        self.shards[name_of_shard] = {
            "frames": sum(item.idx.numel() for item in shard),
            "bytes": sum(_frame_bytes(item.layout, item.idx, item.tensors) for item in shard),
            "groups": groups,
            **written.entry(),  # size (and sha256), listed in the index
        }
        return name_of_shard

    def _mismatch(self, item: _Item) -> ShapeMismatchError:
        old_layout, old_ranks = self.catalog.layout(item.name), self.catalog.ranks(item.name)
        before = f"from ranks {old_ranks}" if old_ranks else "an earlier attempt of this run"
        return ShapeMismatchError(
            f"filename {item.name!r}: frames already written ({before}) have "
            f"{old_layout.describe()}, new ones (from ranks {_ranks_in(item.rank)}) have {item.layout.describe()}; "
            f"{SAME_LAYOUT}"
            f"{ragged_hint(old_layout, item.layout)}"
        )

    def _drop_written(self, items: list[_Item], mismatches: Mismatches | None) -> list[_Item]:
        """Resolve frames already on disk by the policy: the disk copy stays, the new one goes.

        A filename written before with a layout that does not fit (`tdgather.core.promote.common_layout`)
        raises (or, with ``mismatches``, is recorded and left out). Every copy is compared in one
        pass: each shard is opened once per window of rows (`_windows`), not once per filename.
        """
        out: list[_Item | None] = list(items)
        hits: list[tuple[int, torch.Tensor]] = []  # (item, which of its frames are on disk)
        for k, item in enumerate(items):
            layout = self.catalog.layout(item.name)
            if layout is None:
                continue
            if layout != item.layout and (self.fixed or common_layout(layout, item.layout) is None):
                if mismatches is None:
                    raise self._mismatch(item)
                mismatches.setdefault(item.name, (layout, self._mismatch(item)))
                out[k] = None
                continue
            again = in_runs(self.catalog.written(item.name), item.idx)
            if bool(again.any()):
                hits.append((k, again))
                out[k] = _take(item, (~again).nonzero().flatten())
        if hits:
            self._settle()  # the shards read back must be in place
            self._compare_written(items, hits)
        return [item for item in out if item is not None and item.idx.numel()]

    def _compare_written(self, items: list[_Item], hits: list[tuple[int, torch.Tensor]]) -> None:
        """Compare the copies ``hits`` names with the frames on disk, a window of a shard's group at a time."""
        by_group: dict[tuple[str, str], list[tuple[dict, int, torch.Tensor]]] = {}
        for k, again in hits:
            for seg in self.catalog.segments(items[k].name):
                by_group.setdefault((seg["shard"], seg["group"]), []).append((seg, k, again))
        for (shard, group), segs in by_group.items():
            # the copies of one group's rows, as one layout: every filename's, written and new, joined
            layout = items[segs[0][1]].layout
            for k in dict.fromkeys(k for _, k, _ in segs):
                for other in (items[k].layout, self.catalog.layout(items[k].name)):
                    layout = common_layout(layout, other) or layout
            for lo, hi, window in _windows(segs, layout):
                window_seg = {"shard": shard, "group": group, "start": lo, "frames": hi - lo}
                old_idx, old_tensors, old_json = read_segment(self.out.store, window_seg, layout)
                self._compare_window(items, window, lo, layout, old_idx, old_tensors, old_json)

    def _compare_window(
        self, items: list[_Item], window: list, lo: int, layout: Layout, old_idx, old_tensors, old_json
    ) -> None:
        new_rows, old_rows, where = [], [], []  # per copy: its item and row, the row on disk, its segment
        for seg, k, again in window:
            a = seg["start"] - lo
            on_disk = old_idx[a : a + seg["frames"]]
            idx = items[k].idx
            pos = (again & torch.isin(idx, on_disk)).nonzero().flatten()
            if pos.numel():
                new_rows.append((k, pos))
                old_rows.append(a + torch.searchsorted(on_disk, idx[pos]))
                where.extend((seg, k, p) for p in pos.tolist())
        if not new_rows:
            return
        old_pos = torch.cat(old_rows)
        leaves, json_leaves = range(len(layout.leaves)), range(len(layout.nontensor))
        new = [
            promote_columns(items[k].layout, layout, [t.index_select(0, p) for t in items[k].tensors])
            for k, p in new_rows
        ]
        new_tensors = [cat_columns([columns[j] for columns in new]) for j in leaves]
        new_json = [[items[k].json[j][i] for k, p in new_rows for i in p.tolist()] for j in json_leaves]
        verdict = compare(
            layout,
            new_tensors,
            [t.index_select(0, old_pos) for t in old_tensors],
            new_json,
            [[values[i] for i in old_pos.tolist()] for values in old_json],
            self.policy,
        )
        if bool(verdict.refused.any()):
            c = int(verdict.refused.nonzero()[0])
            seg, k, p = where[c]
            raise self._conflict(items[k], p, seg, int(old_pos[c]) - (seg["start"] - lo), verdict.describe(c))
        self.duplicates += verdict.counts

    def _conflict(self, item: _Item, pos: int, seg: dict, row: int, how: str) -> Exception:
        """The error for copy ``pos`` of ``item``, refused against row ``row`` of segment ``seg`` on disk."""
        old = int(self.catalog.rank_rows(seg["k"])[row])
        new = item.rank if isinstance(item.rank, int) else int(item.rank[pos])
        first = f"rank {old}" if old >= 0 else "an earlier attempt of this run"
        later = f"later rank {new}" if new >= 0 else f"a later copy (from ranks {_ranks_in(item.rank)})"
        where = f" (the first copy was written to {seg['shard']} before this one arrived)"
        return conflict(item.name, int(item.idx[pos]), how, self.policy, f"{first} and {later}", where)

    def report(self) -> dict[str, dict]:
        """A writer's part (`tdgather.format.parts`): once its shards are durable, frames, bytes, size, checksums."""
        self._settle()
        return {name: {k: v for k, v in entry.items() if k != "groups"} for name, entry in self.shards.items()}

    def combine(self, parts: Mapping[int, Mapping[str, dict]]) -> DuplicateCounts:
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
        for writer, shards in parts.items():
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
        state = from_shards(store, names, policy=self.policy, frames=False, fixed=self.fixed)
        for name, entry in state.shards.items():  # each shard's size and checksum, as its writer put it
            entry.update({k: sums[name][k] for k in ("size", "sha256", "crc32") if k in sums[name]})
        self.shards, self.catalog = state.shards, Catalog()
        self.catalog.load(state.files, state.layouts, state.written)
        return state.duplicates

    def commit(self, metadata: Mapping[str, Any] | None = None) -> Path | str:
        """Write the index (last), then put the dataset in place; return its path (or URL).

        A writer's part (``part``) writes no index: it only waits until its shards are durable.
        """
        self._settle()
        if self.part is not None:
            self.out.close()
            return self.out.store.where
        return self.out.commit(self._index(metadata), self.shards)

    def set_policy(self, policy: DuplicatePolicy) -> None:
        """The duplicates policy for the writes that follow."""
        self.policy = policy

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
        if failure is not None and self.part is None:  # a writer's failure goes to the coordinator, who records it
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
        first = None
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
        head = json.dumps(index, ensure_ascii=False, allow_nan=False)
        yield (head[:-1] + ', "files": ').encode()
        for piece in self.catalog.json_chunks():
            yield piece.encode()
        yield b"}"


class _Item(NamedTuple):
    """One filename's frames in one write: a shard's unit."""

    name: str
    layout: Layout
    idx: torch.Tensor
    tensors: list
    json: list[list]
    runs: tuple[int, int] | None  # (lo, hi) when idx is the run lo..hi
    rank: Any  # the sender of every row (int, UNKNOWN if not known), or one per row (int32 tensor)


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


def _items(frames: Any, ranks: Mapping[str, set[int]]) -> list[_Item]:
    """One `_Item` per filename, sorted by name."""
    groups = getattr(frames, "groups", None)
    if groups is None:
        items = []
        for name in sorted(frames):
            f = frames[name]
            layout, tensors, json_values = flatten(f.frames, f.frame_idx.numel(), f"filename {name!r}")
            items.append(_Item(name, layout, f.frame_idx, tensors, json_values, None, _one_rank(ranks.get(name))))
        return items
    items = []
    for g in groups:  # views of the group's buffers: nothing is copied or rebuilt per file
        runs, senders = _runs_per_file(g), _senders_per_file(g, ranks)
        for i, name in enumerate(g.files):
            lo, hi = g.starts[i], g.starts[i] + g.counts[i]
            tensors, json_values = [t[lo:hi] for t in g.leaves], [v[lo:hi] for v in g.json]
            items.append(_Item(name, g.layout, g.frame_idx[lo:hi], tensors, json_values, runs[i], senders[i]))
    return sorted(items, key=lambda item: item.name)


def _one_rank(ranks: Any) -> int:
    return next(iter(ranks)) if ranks is not None and len(ranks) == 1 else UNKNOWN


def _runs_per_file(g: Any) -> list[tuple[int, int] | None]:
    """For each file of a group, ``(lo, hi)`` when its frame_idx (sorted, distinct) are the run lo..hi, else None."""
    if not g.frame_idx.numel():
        return [None] * len(g.files)
    starts, counts = torch.tensor(g.starts, dtype=torch.int64), torch.tensor(g.counts, dtype=torch.int64)
    lo, hi = g.frame_idx[starts], g.frame_idx[starts + counts - 1]
    one_run = (hi - lo + 1 == counts) & (counts > 0)
    return [(a, b) if ok else None for a, b, ok in zip(lo.tolist(), hi.tolist(), one_run.tolist(), strict=True)]


def _senders_per_file(g: Any, ranks: Mapping[str, set[int]]) -> list[Any]:
    """For each file of a group, the rank that sent all its rows, or (several) each row's, as `_Item.rank`.

    The ranks given for a filename come first; else the group's ``rank`` of each row, where it has one.
    """
    rank = getattr(g, "rank", None)
    if ranks or rank is None or not rank.numel():
        return [_one_rank(ranks.get(name)) for name in g.files]
    counts = torch.tensor(g.counts, dtype=torch.int64)
    file_of = torch.repeat_interleave(torch.arange(len(g.files)), counts)
    low = torch.full((len(g.files),), 1 << 30, dtype=torch.int32).scatter_reduce(0, file_of, rank, "amin")
    high = torch.full((len(g.files),), -1, dtype=torch.int32).scatter_reduce(0, file_of, rank, "amax")
    return [
        a if a == b else rank[s : s + n]
        for a, b, s, n in zip(low.tolist(), high.tolist(), g.starts, g.counts, strict=True)
    ]


def _take(item: _Item, rows: torch.Tensor) -> _Item:
    """``item`` with only ``rows`` of its frames."""
    rank = item.rank[rows] if isinstance(item.rank, torch.Tensor) else item.rank
    json_values = [[values[k] for k in rows.tolist()] for values in item.json]
    tensors = [t.index_select(0, rows) for t in item.tensors]
    return _Item(item.name, item.layout, item.idx[rows], tensors, json_values, None, rank)


def _ranks_in(rank: Any) -> list[int]:
    """The known ranks an `_Item.rank` names."""
    ranks = rank.unique().tolist() if isinstance(rank, torch.Tensor) else [rank]
    return [r for r in ranks if r >= 0]


_WINDOW_BYTES = 16 << 20  # rows of a shard's group read back at once to compare copies with


def _windows(segs: list[tuple[dict, int, Any]], layout: Layout) -> Iterator[tuple[int, int, list]]:
    """``segs`` (of one shard's group) by start, in windows of rows ``lo:hi`` of at most `_WINDOW_BYTES`."""
    most = max(1, _WINDOW_BYTES // max(1, layout.frame_nbytes))
    window: list = []
    lo = hi = 0
    for seg in sorted(segs, key=lambda s: s[0]["start"]):
        start, end = seg[0]["start"], seg[0]["start"] + seg[0]["frames"]
        if window and end - lo > most:
            yield lo, hi, window
            window = []
        if not window:
            lo = hi = start
        window.append(seg)
        hi = max(hi, end)
    if window:
        yield lo, hi, window


def _shard_tensors(shard: list) -> tuple[dict, list, list]:
    """Group a shard's filenames by layout; return group descriptions, tensor entries and each one's segment.

    A segment is ``(group, start, frames)``, in the order of ``shard``.
    """
    by_layout: dict[Layout, list[int]] = {}  # each layout's items, by their place in the shard
    for k, item in enumerate(shard):
        by_layout.setdefault(item[1], []).append(k)
    groups, entries, segments = {}, [], [None] * len(shard)
    for g, (layout, places) in enumerate(by_layout.items()):
        key = f"g{g}"
        names = group_names(key, layout, int(SHARD_VERSION))
        groups[key] = layout.to_json()
        items = [shard[k] for k in places]
        row = 0
        for k, item in zip(places, items, strict=True):
            n = item[2].numel()
            segments[k] = (key, row, n)
            row += n
        entries.append((names.frame_idx, torch.int64, (row,), [x[2] for x in items]))
        for j, (name, leaf) in enumerate(zip(names.leaves, layout.leaves, strict=True)):
            column = [x[3][j] for x in items]
            if leaf.ragged:  # values, then offsets: frame i is rows offsets[i] : offsets[i + 1]
                spans = [r.span() for r in joined(column)]
                offsets = offsets_of(torch.cat([n for _, n in spans]))
                values = [v for v, _ in spans]
                entries.append((name, leaf.dtype, (int(offsets[-1]), *leaf.shape), values))
                entries.append((names.offsets(name), torch.int64, (row + 1,), [offsets]))
            else:
                entries.append((name, leaf.dtype, (row, *leaf.shape), column))
        for j, name in enumerate(names.json):
            lines = [
                json.dumps(v, ensure_ascii=False, allow_nan=False).encode() + b"\n" for x in items for v in x[4][j]
            ]
            offsets = torch.tensor([0, *map(len, lines)], dtype=torch.int64).cumsum(0)
            blob = torch.frombuffer(bytearray(b"".join(lines)), dtype=torch.uint8)
            entries.append((name, torch.uint8, (blob.numel(),), [blob]))
            entries.append((names.offsets(name), torch.int64, (row + 1,), [offsets]))
    return groups, entries, segments


def _frame_bytes(layout: Layout, idx: torch.Tensor, tensors: list) -> int:
    """Tensor bytes of one filename's frames: the fixed leaves', and its ragged leaves' values."""
    return idx.numel() * layout.frame_nbytes + sum(t.nbytes for t in tensors if isinstance(t, Ragged))


def output_at(path: Any, storage_options: dict | None = None, fs: LocalFS | None = None, store: Store | None = None):
    """Where a dataset at ``path`` is written: a `PrefixOutput` for an object store URL, else a `LocalOutput`.

    ``fs``: the local filesystem seam; ``store``: the object store itself (a test's double), for a URL.
    """
    store = store or store_at(path, storage_options)
    return LocalOutput(path, fs) if store.local else PrefixOutput(store)
