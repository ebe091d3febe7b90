"""Stage 5, the sink: sharded safetensors plus a JSON index, atomic and durable.

Layout of a dataset directory (documented in the README)::

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
with ``:offsets`` (int64 ``[N+1]`` byte offsets); `tdgather._names` has the escaping
rule. The index maps each filename to its segments
(shard, group, first row, frame count), so reading one filename reads only its
rows. A one-shot `save` gives each filename one segment; a streaming
`tdgather.Collector` may give it one per shard it wrote while frames arrived.

Writes go to a staging directory ``<name>.partial`` beside the target. Every
file is written to a temporary name, fsynced, renamed, and the directory
fsynced; the index comes last; then the staging directory is moved into place.
What may be replaced, and how, is `tdgather._output`'s (the output directory's rules).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ._dtypes import SAFETENSORS_CODE
from ._gc import collection_paused
from ._index_check import SHARD_NAME
from ._names import group_names
from ._output import (
    FORMAT,
    INCOMPLETE_NAME,
    INDEX_NAME,
    SHARD_VERSION,
    check_output,
    fsync_dir,
    lock_dir,
    publish,
    remove_ours,
    staging_of,
)
from ._runs import add_runs, in_runs
from .duplicates import DuplicateCounts, DuplicatePolicy, compare, conflict
from .errors import FrameConflictError, OutputError, ShapeMismatchError
from .frames import Frames, Layout, flatten, ragged_hint
from .merge import Rows
from .plan import Mismatches
from .ragged import Ragged, joined, offsets_of
from .reader import read_segment
from .resume import SavedState, from_shards, load_state, new_run
from .writers import index_version, next_number, shard_name

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "FORMAT",
    "INCOMPLETE_NAME",
    "INDEX_NAME",
    "DatasetWriter",
    "check_output",
    "save",
    "write_safetensors",
]

DEFAULT_SHARD_BYTES = 1 << 30


class DatasetWriter:
    """Writes a dataset incrementally: shards as they fill, the index last.

    Call order (rank ``dst`` only):

    1. ``DatasetWriter(path, ...)`` checks the output and opens ``<path>.partial``;
    2. ``write(frames)`` any number of times: each call writes one or more shards (their fsync and
       rename into place run on a background thread, overlapping what comes next). A filename
       may appear in several calls; its frames then form several segments, and a frame already
       written is compared with its copy on disk and resolved by the duplicates policy (the
       copy on disk stays; the new one is dropped and counted, or refused);
    3. ``commit()`` waits until every shard is durable, writes the index and moves the dataset
       into place; or ``abort()``, which
       keeps the committed shards in ``<path>.partial`` and writes no index there, only (given
       the failure) ``tdgather.incomplete.json``, which lists them.

    With several writers (`tdgather.writers`), ``writer`` numbers this writer's shards; the
    coordinator's writer calls ``combine`` with the others' reports before ``commit``. Another
    writer is a ``part`` (the run id and attempt the coordinator gave): it writes into the
    coordinator's ``<path>.partial`` without checking or locking it, its ``commit`` writes no index
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
    ) -> None:
        self.policy = DuplicatePolicy.of(duplicates)
        self.max_shard_bytes = max_shard_bytes
        self.writer, self.part = writer, part
        if part is not None:  # one writer's part of a dataset the coordinator opened (`tdgather.writers`)
            self.target = Path(path)
            self.staging = staging_of(self.target)
            self._lock = None
            if not self.staging.is_dir():
                raise OutputError(
                    f"{str(self.staging)!r}, which rank dst made, is not there as this rank sees it: with "
                    "ranks_per_writer, every writer writes into one output directory, on a filesystem all of them "
                    "share (or use one Collector per node, each with its own path)"
                )
            state = SavedState(part[0])
            existing = [n for n in os.listdir(self.staging) if SHARD_NAME.fullmatch(n)]
        else:
            self.target = check_output(path, overwrite, resume)
            self.staging = staging_of(self.target)
            state = self._open_staging(overwrite, resume)
            existing = list(state.shards)
        # resuming a complete dataset replaces it with one that holds all its frames
        self.overwrite = overwrite or (resume and (self.target / INDEX_NAME).is_file())
        self.run, self.attempts, self.attempt = state.run, state.attempts, part[1] if part else state.attempt
        self.saved = state.saved()  # what earlier attempts saved, as every rank gets it
        self.files: dict[str, dict] = state.files
        self.shards: dict[str, dict] = state.shards
        self._saved_frames = self.frames
        self._next_shard = next_number(existing, writer)
        self.duplicates = DuplicateCounts()  # copies dropped against frames already on disk
        self._ranks: dict[str, set[int]] = {}  # per filename, the ranks whose frames were written
        self._layouts: dict[str, Layout] = dict(state.layouts)
        self._written: dict[str, torch.Tensor] = state.written  # per filename, frame_idx written, as runs
        self._syncer: ThreadPoolExecutor | None = None  # makes shards durable while the next is written
        self._syncing: list[tuple[str, Future]] = []
        self._failed: list[str] = []  # shards whose last step failed: never listed

    def _open_staging(self, overwrite: bool, resume: bool) -> SavedState:
        """Lock ``<path>.partial`` (no other job writes there now); what it holds to continue from, or a fresh one."""
        self._lock = lock_dir(self.staging) if self.staging.is_dir() else None
        try:
            state = load_state(self.target, self.staging, overwrite) if resume else None
            if state is None:
                remove_ours(self.staging)  # check_output allowed only tdgather's own files there
                self.staging.mkdir()
                self._unlock()  # the removed directory's
                state = SavedState(new_run())
            if self._lock is None:  # a new staging directory (fresh, or made from a complete dataset)
                self._lock = lock_dir(self.staging)
        except BaseException:
            self._unlock()
            raise
        return state

    @property
    def frames(self) -> int:
        """Frames committed so far."""
        return sum(s["frames"] for s in self.shards.values())

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
            ranks: for each filename, the ranks that sent these frames (named in conflict errors).
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
        shards: list[list[tuple]] = [[]]
        size = 0
        for name, layout, idx, tensors, json_values, runs in _items(frames):
            if mismatches is not None and self._layouts.get(name, layout) != layout:
                mismatches.setdefault(name, (self._layouts[name], self._mismatch(name, layout, ranks)))
                continue
            if name in self._layouts:
                idx, tensors, json_values = self._drop_written(name, layout, idx, tensors, json_values, ranks)
                runs = None
                if not idx.numel():
                    continue
            nbytes = _frame_bytes(layout, idx, tensors)
            if shards[-1] and size + nbytes + 8 * idx.numel() > self.max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, layout, idx, tensors, json_values, runs, nbytes))
            size += nbytes + 8 * idx.numel()
        written = []
        for shard in (s for s in shards if s):
            name_of_shard = shard_name(self.writer, self._next_shard)
            self._next_shard += 1
            groups, entries, segments = _shard_tensors(shard, name_of_shard)
            record = [
                [item[0], seg["group"], seg["start"], seg["frames"]] for item, seg in zip(shard, segments, strict=True)
            ]
            meta = {
                "format": FORMAT,
                "version": SHARD_VERSION,
                "shard": name_of_shard,
                "groups": json.dumps(groups),
                "segments": json.dumps(record, ensure_ascii=False),  # what a resumed run reads back
                "run": self.run,
                "attempt": str(self.attempt),
            }
            write_safetensors(self.staging / name_of_shard, entries, meta, then=self._in_background(name_of_shard))
            for (name, layout, idx, _, _, runs, _), segment in zip(shard, segments, strict=True):
                entry = self.files.setdefault(name, {"frames": 0, "segments": []})
                entry["frames"] += segment["frames"]
                entry["segments"].append(segment)
                self._layouts[name] = layout
                old = self._written.get(name)
                self._written[name] = runs if old is None and runs is not None else add_runs(old, idx)
                self._ranks.setdefault(name, set()).update(ranks.get(name, ()))
            self.shards[name_of_shard] = {
                "frames": sum(x[2].numel() for x in shard),
                "bytes": sum(x[6] for x in shard),
                "groups": groups,
            }
            written.append(name_of_shard)
        return written

    def _written_by(self, name: str, ranks: str) -> str:
        """Who wrote ``name``'s frames on disk: ``ranks`` (formatted with the list), or an earlier attempt."""
        old_ranks = sorted(self._ranks.get(name, ()))
        return ranks.format(old_ranks) if old_ranks else "an earlier attempt of this run"

    def _mismatch(self, name: str, layout: Layout, ranks: Mapping) -> ShapeMismatchError:
        new_ranks = sorted(ranks.get(name, ()))
        return ShapeMismatchError(
            f"filename {name!r}: frames already written ({self._written_by(name, 'from ranks {}')}) have "
            f"{self._layouts[name].describe()}, new ones (from ranks {new_ranks}) have {layout.describe()}; "
            "every frame of a filename must have the same structure, shape and dtype"
            f"{ragged_hint(self._layouts[name], layout)}"
        )

    def _drop_written(
        self, name: str, layout: Layout, idx: torch.Tensor, tensors: list, json_values: list, ranks: Mapping
    ) -> tuple:
        """Resolve frames of ``name`` already on disk by the policy: the disk copy stays, the new one goes."""
        if layout != self._layouts[name]:
            raise self._mismatch(name, layout, ranks)
        again = in_runs(self._written[name], idx)
        if not bool(again.any()):
            return idx, tensors, json_values
        self._settle()  # the shards read back must be in place

        for segment in self.files[name]["segments"]:
            old_idx, old_tensors, old_json = read_segment(self.staging, segment, layout)
            new_pos = (again & torch.isin(idx, old_idx)).nonzero().flatten()
            if not new_pos.numel():
                continue
            old_pos = torch.searchsorted(old_idx, idx[new_pos])
            verdict = compare(
                layout,
                [t.index_select(0, new_pos) for t in tensors],
                [t.index_select(0, old_pos) for t in old_tensors],
                [[values[k] for k in new_pos.tolist()] for values in json_values],
                [[values[k] for k in old_pos.tolist()] for values in old_json],
                self.policy,
            )
            if bool(verdict.refused.any()):
                k = int(verdict.refused.nonzero()[0])
                who = f"{self._written_by(name, 'rank(s) {}')} and later rank(s) {sorted(ranks.get(name, ()))}"
                where = f" (the first copy was written to {segment['shard']} before this one arrived)"
                raise conflict(name, int(idx[new_pos[k]]), verdict.describe(k), self.policy, who, where)
            self.duplicates += verdict.counts
        keep = (~again).nonzero().flatten()
        kept_json = [[values[k] for k in keep.tolist()] for values in json_values]
        return idx[keep], [t.index_select(0, keep) for t in tensors], kept_json

    def report(self) -> dict[str, dict]:
        """A writer's part (`tdgather.writers`): once every shard is durable, each one's frames, bytes and file size."""
        self._settle()
        return {
            name: {**{k: v for k, v in entry.items() if k != "groups"}, "size": (self.staging / name).stat().st_size}
            for name, entry in self.shards.items()
        }

    def combine(self, parts: Mapping[int, Mapping[str, dict]]) -> DuplicateCounts:
        """The coordinator's step before ``commit``: take every writer's shards, as ``{writer: report}``.

        Each shard reported must be in ``<path>.partial`` as this rank sees it, at the size its writer
        wrote. Every shard's own record is read back (checked as `tdgather.open` checks a dataset),
        copies of one frame held by several writers are resolved by the policy, and the result is what
        ``commit`` lists. Returns the copies dropped.

        Raises:
            OutputError: a shard reported is missing or of another size (the output is not shared).
            DuplicateFrameError, ShapeMismatchError: copies the policy refuses; two layouts for a filename.
        """
        self._settle()
        for writer, shards in parts.items():
            for name, entry in shards.items():
                path = self.staging / name
                size = path.stat().st_size if path.is_file() else None
                if size != entry["size"]:
                    seen = "is missing" if size is None else f"has {size} bytes"
                    raise OutputError(
                        f"writer {writer} wrote {name} ({entry['size']} bytes) into {str(self.staging)!r}, which here "
                        f"{seen}: with ranks_per_writer, the output must be on a filesystem every writer shares"
                    )
        names = sorted({*self.shards, *(name for shards in parts.values() for name in shards)})
        if not names:  # no writer had a frame: an empty dataset
            return DuplicateCounts()
        state = from_shards(self.staging, names, policy=self.policy, frames=False)
        self.shards, self.files = state.shards, state.files
        return state.duplicates

    def commit(self, metadata: Mapping[str, Any] | None = None) -> Path:
        """Write the index (last), then move the dataset into place; return its path.

        A writer's part (``part``) writes no index: it only waits until its shards are durable.
        """
        self._settle()
        if self.part is not None:
            return self.staging
        (self.staging / INCOMPLETE_NAME).unlink(missing_ok=True)  # an earlier attempt's record
        _write_atomic(self.staging / INDEX_NAME, [self._index(metadata)])
        publish(self.staging, self.target, self.overwrite)
        self._unlock()
        return self.target

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def abort(
        self, failure: BaseException | None = None, metadata: Mapping[str, Any] | None = None, rank: int | None = None
    ) -> Path:
        """Stop: the committed shards stay in ``<path>.partial``; return that path.

        With ``failure``, an index of what was committed is written there as ``tdgather.incomplete.json``
        (never ``tdgather.index.json``), naming the failure, so ``tdgather.open(path, incomplete=True)``
        reads the frames saved before it. Its ``rank`` is the failure's own (a peer's error), else
        ``rank`` (the writer's, whose own code raised), and null for a conflict between ranks.
        """
        failed = self._settle(raise_first=False)
        for name in failed:  # a shard that never became durable is not listed
            self.shards.pop(name, None)
            for entry in self.files.values():
                entry["segments"] = [seg for seg in entry["segments"] if seg["shard"] != name]
                entry["frames"] = sum(seg["frames"] for seg in entry["segments"])
        self.files = {name: entry for name, entry in self.files.items() if entry["segments"]}
        if failure is not None and self.part is None:  # a writer's failure goes to the coordinator, who records it
            who = getattr(failure, "rank", None)
            if who is None and not isinstance(failure, FrameConflictError):
                who = rank
            info = {"type": type(failure).__name__, "message": str(failure), "rank": who}
            _write_atomic(self.staging / INCOMPLETE_NAME, [self._index({**(metadata or {}), "failure": info}, info)])
        self._unlock()
        return self.staging

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

    def _index(self, metadata: Mapping[str, Any] | None, failure: dict | None = None) -> bytes:
        this = {"attempt": self.attempt, "frames": self.frames - self._saved_frames, "failure": failure}
        index = {
            "format": FORMAT,
            "version": index_version(self.shards),
            "metadata": {
                **(metadata or {}),
                "run": self.run,
                "attempts": [*self.attempts, this],  # how many frames each attempt saved, and how it ended
                "total_frames": self.frames,
                "total_bytes": self.nbytes,
                "num_filenames": len(self.files),
            },
            "shards": self.shards,
            "files": dict(sorted(self.files.items())),
        }
        return json.dumps(index, ensure_ascii=False, allow_nan=False).encode()


def save(
    frames: Mapping[str, Frames],
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write gathered frames as a dataset directory (see the module docstring).

    Args:
        frames: ``{filename: Frames}``, as `tdgather.gather` returns on rank ``dst``.
        path: the dataset directory to create.
        overwrite: replace an existing tdgather dataset (atomically: the old one stays whole until the
            swap). A directory that is not a tdgather dataset is refused, even with this.
        max_shard_bytes: start a new shard when a shard would grow past this; one filename
            never spans shards in one call.
        metadata: extra JSON values stored in the index under ``"metadata"`` (with, for a
            `tdgather.Gathered`, its duplicate counts).

    Returns:
        The dataset directory.
    """
    stats = getattr(frames, "stats", None)  # a Gathered: its duplicate counts go in the index too
    if stats is not None:
        dups = {"duplicates_dropped": stats.duplicates.dropped, "duplicates": stats.duplicates.to_json()}
        metadata = {**dups, **(metadata or {})}
    writer = DatasetWriter(path, overwrite=overwrite, max_shard_bytes=max_shard_bytes)
    try:
        writer.write(frames)
        return writer.commit(metadata)
    except BaseException:
        if not (writer.staging / INDEX_NAME).exists():  # the caller still holds the frames: leave nothing
            remove_ours(writer.staging)
        writer._unlock()
        raise


def _items(frames: Any) -> list[tuple]:
    """``(name, layout, frame_idx, tensors, json, runs or None)`` per filename, sorted by name."""
    groups = getattr(frames, "groups", None)
    if groups is None:
        items = []
        for name in sorted(frames):
            f = frames[name]
            layout, tensors, json_values = flatten(f.frames, f.frame_idx.numel(), f"filename {name!r}")
            items.append((name, layout, f.frame_idx, tensors, json_values, None))
        return items
    items = []
    for g in groups:  # views of the group's buffers: nothing is copied or rebuilt per file
        runs = _runs_per_file(g)
        for i, name in enumerate(g.files):
            lo, hi = g.starts[i], g.starts[i] + g.counts[i]
            items.append(
                (name, g.layout, g.frame_idx[lo:hi], [t[lo:hi] for t in g.leaves], [v[lo:hi] for v in g.json], runs[i])
            )
    return sorted(items, key=lambda item: item[0])


def _runs_per_file(g: Any) -> list[torch.Tensor]:
    """For each file of a group, its frame_idx as `_add_runs` keeps them, for all files at once."""
    idx, n = g.frame_idx, g.frame_idx.numel()
    if not n:
        return [torch.empty(0, 2, dtype=torch.int64) for _ in g.files]
    file_of = torch.repeat_interleave(torch.arange(len(g.files)), torch.tensor(g.counts, dtype=torch.int64))
    head = torch.ones(n, dtype=torch.bool)
    head[1:] = (file_of[1:] != file_of[:-1]) | (idx[1:] - idx[:-1] != 1)
    heads = head.nonzero().flatten()
    tails = torch.cat([heads[1:] - 1, torch.tensor([n - 1])])
    runs = torch.stack([idx[heads], idx[tails]], dim=1)
    return list(torch.split(runs, torch.bincount(file_of[heads], minlength=len(g.files)).tolist()))


def _shard_tensors(shard: list, shard_file: str) -> tuple[dict, list, list]:
    """Group a shard's filenames by layout; return group descriptions, tensor entries and segments."""
    by_layout: dict[Layout, list] = {}
    for item in shard:
        by_layout.setdefault(item[1], []).append(item)
    groups, entries, segment_of = {}, [], {}
    for g, (layout, items) in enumerate(by_layout.items()):
        key = f"g{g}"
        names = group_names(key, layout, int(SHARD_VERSION))
        groups[key] = layout.to_json()
        row = 0
        for name, _, idx, *_ in items:
            segment_of[name] = {"shard": shard_file, "group": key, "start": row, "frames": idx.numel()}
            row += idx.numel()
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
    return groups, entries, [segment_of[item[0]] for item in shard]


def _frame_bytes(layout: Layout, idx: torch.Tensor, tensors: list) -> int:
    """Tensor bytes of one filename's frames: the fixed leaves', and its ragged leaves' values."""
    return idx.numel() * layout.frame_nbytes + sum(t.nbytes for t in tensors if isinstance(t, Ragged))


def write_safetensors(
    path: Path,
    entries: list[tuple[str, torch.dtype, tuple, list]],
    metadata: dict[str, str],
    then: Callable[[Callable[[], None]], None] | None = None,
) -> None:
    """Write a safetensors file atomically, streaming each tensor from its pieces (no staging copy).

    Args:
        path: the final file name; a temporary name beside it is written first.
        entries: ``(name, dtype, shape, pieces)``; the pieces (tensors, or `tdgather.merge.Rows`),
            concatenated on dim 0, make the tensor.
        metadata: str -> str, stored as ``__metadata__``.
        then: given, the last step (fsync, rename into place, fsync the directory) is handed to it
            to run later, for example on another thread; else it runs before this returns.
    """
    entries = sorted(entries, key=lambda e: -e[1].itemsize)  # keeps every tensor aligned to its itemsize
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, _ in entries:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": SAFETENSORS_CODE[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)

    def chunks():
        yield struct.pack("<Q", len(raw)) + raw
        for _, _, _, pieces in entries:
            yield from _byte_views(pieces)

    _write_atomic(path, chunks(), then)


def _byte_views(pieces: list) -> list[memoryview]:
    """The pieces' bytes in order: neighbours in one storage (or one `Rows`) joined into one view."""
    out: list = []
    for piece in pieces:
        if not len(piece):
            continue
        if isinstance(piece, Rows):
            if out and isinstance(out[-1], Rows) and piece.follows(out[-1]):
                piece = Rows(piece.sources, piece.src, piece.row, out.pop().lo, piece.hi)
            out.append(piece)
            continue
        b = piece.detach().cpu().contiguous().view(-1).view(torch.uint8)
        last = out[-1] if out and isinstance(out[-1], torch.Tensor) else None
        if last is not None and last.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
            if last.storage_offset() + last.numel() == b.storage_offset():
                out[-1] = torch.empty(0, dtype=torch.uint8).set_(
                    last.untyped_storage(), last.storage_offset(), (last.numel() + b.numel(),)
                )
                continue
        out.append(b)
    views: list[memoryview] = []
    for x in out:
        views += x.byte_views() if isinstance(x, Rows) else [memoryview(x.numpy())]
    return views


_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)
_BATCH_BYTES = 64 << 20


def _write_all(fd: int, chunks: Iterable) -> None:
    """Write every chunk in order, gathered into few ``writev`` calls."""
    batch: list = []
    size = 0
    for chunk in chunks:
        batch.append(chunk)
        size += len(chunk)
        if len(batch) >= _IOV_MAX or size >= _BATCH_BYTES:
            _writev(fd, batch)
            batch, size = [], 0
    _writev(fd, batch)


def _writev(fd: int, views: list) -> None:
    k = 0
    while k < len(views):
        n = os.writev(fd, views[k : k + _IOV_MAX])
        while k < len(views) and n >= len(views[k]):
            n -= len(views[k])
            k += 1
        if n:  # a short write stopped inside this buffer
            views[k] = memoryview(views[k])[n:]


def _write_atomic(path: Path, chunks: Any, then: Callable[[Callable[[], None]], None] | None = None) -> None:
    """Write ``chunks`` to a temporary name beside ``path``, then fsync it, rename it and fsync the directory.

    With ``then``, that last step is handed to it instead of run here (see `write_safetensors`).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        raise OutputError(f"writing {str(path)!r} failed ({e}); files already committed stay valid") from e
    try:
        _write_all(fd, chunks)
    except BaseException as e:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OutputError(f"writing {str(path)!r} failed ({e}); files already committed stay valid") from e
        raise

    def finish() -> None:
        try:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise OutputError(f"writing {str(path)!r} failed ({e}); files already committed stay valid") from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    if then is None:
        finish()
    else:
        then(finish)
