"""Snapshots of a dataset that many jobs append to: which there are, the newest, and each one's record.

A job that appends (``Collector(path, append=True)``, ``save(..., append=True)``) commits by writing
the next snapshot, ``tdgather.snapshot-NNNNNNNN.json``: a whole index (the earlier snapshot's shards
and filenames, plus the job's) with a ``snapshot`` record saying which it is, when, and by whom
(`tdgather.storage.append`). A snapshot is written once, whole, and never replaced. Snapshot 0 is
the dataset's ``tdgather.index.json`` where it has one (a dataset written before any job appended).
`tdgather.open` reads the newest (``version=`` an earlier one); `snapshots` lists them.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Any

from ..errors import DatasetError, OutputError
from ..format.check import Check, check_index, load_json
from ..format.names import INDEX_NAME, SNAPSHOT_NAME, snapshot_name
from ..format.records import SnapshotRecord
from .location import store_at
from .store import Store

__all__ = [
    "Snapshot",
    "check_not_appended",
    "index_name",
    "read_snapshot",
    "snapshot_at",
    "snapshot_file",
    "snapshot_numbers",
    "snapshots",
]


def snapshot_numbers(store: Store, listing: Any = None) -> list[int]:
    """The snapshots a store holds, in order (0: its ``tdgather.index.json``, where there is one)."""
    listing = store.list() if listing is None else listing
    numbers = sorted(int(m[1]) for m in map(SNAPSHOT_NAME.fullmatch, listing) if m)
    return ([0] if INDEX_NAME in listing else []) + [n for n in numbers if n > 0]


def snapshot_file(number: int) -> str:
    """Snapshot ``number``'s file: ``tdgather.index.json`` for 0, else ``tdgather.snapshot-NNNNNNNN.json``."""
    return INDEX_NAME if number == 0 else snapshot_name(number)


def read_snapshot(store: Store, number: int) -> dict:
    """Snapshot ``number``, checked whole as `tdgather.open` checks an index (its record too)."""
    name = snapshot_file(number)
    c = Check(store.path(name))
    index = load_json(store.read(name), c, "index")
    check_index(index, store.path(name), incomplete=False)
    return index


def check_not_appended(store: Store, target: Any) -> None:
    """Refuse to write a dataset (``overwrite``, ``resume``, or anew) where jobs append (snapshots 1 on).

    Another job may be committing there at any moment: replacing the dataset under it would lose
    that job's frames, or leave snapshots that list shards the rewrite removed.

    Raises:
        OutputError: naming the snapshots there and the choices.
    """
    numbers = [n for n in snapshot_numbers(store) if n > 0]
    if numbers:
        raise OutputError(
            f"{str(target)!r} is a dataset that jobs append to (snapshots {numbers[0]}..{numbers[-1]}): add to it "
            "with append=True; tdgather never replaces it, even with overwrite=True, since a job may be committing "
            "there: write elsewhere, or remove it yourself once no job uses it"
        )


def index_name(store: Store, version: int | None = None) -> str | None:
    """The file to read: snapshot ``version`` (None: the newest); None where the store holds no snapshot or index.

    Raises:
        OutputError: no snapshot ``version`` there (the message lists those there are).
    """
    numbers = snapshot_numbers(store)
    if version is None:
        return snapshot_file(numbers[-1]) if numbers else None
    if isinstance(version, bool) or not hasattr(version, "__index__"):
        raise TypeError(f"version: expected a snapshot number (an int), got {version!r}")
    version = operator.index(version)  # a numpy integer too
    if version not in numbers:
        there = ", ".join(map(str, numbers[-20:])) or "none"
        raise OutputError(f"{store.where!r}: no snapshot version={version!r} (there are: {there})")
    return snapshot_file(version)


@dataclass(frozen=True)
class Snapshot:
    """One snapshot of a dataset, as its record says (`snapshots` lists them).

    Attributes:
        version: its number (``tdgather.open(path, version=...)`` reads it); 0 is the dataset
            written before any job appended.
        made: when it was committed (UTC, ISO 8601); None for snapshot 0.
        run: the run id of the job that committed it.
        host: the host that job ran on; job: its scheduler's id (a SLURM array task, a Kubernetes
            indexed job's index), where one was set.
        frames, filenames: what the snapshot holds in all.
        added: the frames the job added; duplicates_dropped: those it sent that an earlier
            snapshot already held (dropped: each frame is in the dataset once).
        compacted: for a compaction's snapshot (`tdgather.compact`), the snapshot whose frames it
            rewrote into new shards (it adds none); None for a job's.
    """

    version: int
    made: str | None
    run: str | None
    host: str | None
    job: str | None
    frames: int
    filenames: int
    added: int
    duplicates_dropped: int
    compacted: int | None = None


def snapshot_at(store: Store, number: int) -> Snapshot:
    """Snapshot ``number`` of ``store``, as its metadata and record say (checked); nothing else is read.

    Raises:
        DatasetError: its record is malformed, or names another version than its file.
    """
    name = snapshot_file(number)
    c = Check(store.path(name))
    index = c.mapping(load_json(store.read(name), c, "index"), "index")
    meta = c.mapping(index.get("metadata"), "metadata")
    frames = c.int(meta.get("total_frames"), "metadata.total_frames")
    filenames = c.int(meta.get("num_filenames"), "metadata.num_filenames")
    if number == 0:
        return Snapshot(0, None, meta.get("run"), None, None, frames, filenames, frames, 0)
    r = SnapshotRecord.from_json(index.get("snapshot"), c, "snapshot")
    if r.version != number:
        raise DatasetError(c.file, "snapshot.version", f"expected {number}, the number in its name, got {r.version}")
    return Snapshot(number, r.made, r.run, r.host, r.job, frames, filenames, r.added, r.duplicates_dropped, r.compacted)


def snapshots(path: str | os.PathLike, storage_options: dict | None = None) -> list[Snapshot]:
    """The snapshots of the dataset at ``path`` (a directory or an object store URL), oldest first.

    Each is read and checked as `tdgather.open` checks the index's metadata; nothing else is read.

    Raises:
        DatasetError: a snapshot whose record is malformed (named).
    """
    store = store_at(path, storage_options)
    return [snapshot_at(store, number) for number in snapshot_numbers(store)]
