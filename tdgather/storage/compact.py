"""`compact`: the newest snapshot of a dataset that jobs append to, rewritten into fewer shards, as a new snapshot.

Each job that appends adds one or more shards, and a filename that several jobs sent frames of
has a segment per job; the rows of dropped duplicates stay in their shards, unlisted. Reading
such a dataset costs a shard header per shard and a read per segment. Compaction reads the
newest snapshot ``N`` (every shard checked, as `tdgather.open` checks it) and writes its frames
again: each filename's frames in one segment, ordered by frame_idx, as the types of the dataset's
schema hold them, in shards of up to ``max_shard_bytes`` named by the compaction's own run. It
commits as a job does (`tdgather.storage.append`: the next snapshot, written only if absent), as
a snapshot whose record says ``compacted: N``:

- the new snapshot lists the compacted shards in place of snapshot ``N``'s; where jobs committed
  after ``N`` while the compaction ran, it lists their shards and segments too, as they committed
  them (appends never change a segment that ``N`` lists: a later job's frames are segments of its
  own shards);
- its schema is ``N``'s: a reader sees the same filenames, frames and types, bit for bit;
- a compaction that finds ``N``'s shards no longer all listed in the newest snapshot (another
  compaction committed first) commits nothing and removes its shards (`OutputError`).

Nothing is removed: snapshot ``N`` and the earlier ones still list the old shards and read as
they were committed, until `tdgather.storage.expire` removes what no kept snapshot lists.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from ..core.frames import Layout
from ..core.promote import schema
from ..errors import OutputError
from ..format.codec import BytesSource
from .append import AppendOutput, totals
from .location import store_at
from .reader import Dataset
from .shards import frame_bytes
from .snapshots import Snapshot, snapshot_at, snapshot_numbers
from .store import Store
from .writer import DEFAULT_SHARD_BYTES, DatasetWriter

__all__ = ["CompactOutput", "compact"]


class CompactOutput(AppendOutput):
    """A compaction's commit: snapshot ``compacts``'s shards replaced by the compaction's (the module's rules)."""

    def __init__(self, store: Store, compacts: int, base: dict) -> None:
        super().__init__(store)
        self.compacts = compacts
        self._old = set(base["shards"])  # what the compaction's shards replace
        self._files = {name: entry["frames"] for name, entry in base["files"].items()}

    def next_index(self, number: int, base: dict | None, mine: dict) -> tuple[dict, int, int]:
        """Snapshot ``number`` (``base``) with the compacted snapshot's shards replaced by this compaction's.

        Raises:
            OutputError: ``base`` no longer lists all of them (another compaction committed first),
                or the frames written are not the compacted snapshot's; nothing is committed.
        """
        if base is None or not self._old <= set(base["shards"]):
            raise OutputError(
                f"{self.target!r}: snapshot {number} no longer lists all the shards of snapshot {self.compacts}, "
                f"which this compaction rewrote: another compaction committed first. Nothing was committed"
            )
        written = {name: entry["frames"] for name, entry in mine["files"].items()}
        if written != {name: n for name, n in self._files.items() if n}:
            raise OutputError(
                f"{self.target!r}: the compaction of snapshot {self.compacts} wrote other frames than it holds; "
                "nothing was committed"
            )
        files = {}
        for name, entry in base["files"].items():  # a later job's segments follow the compacted ones
            segments = (mine["files"].get(name) or {"segments": []})["segments"]
            segments = segments + [s for s in entry["segments"] if s["shard"] not in self._old]
            files[name] = {"frames": sum(s["frames"] for s in segments), "segments": segments}
        shards = {name: entry for name, entry in base["shards"].items() if name not in self._old}
        shards.update(mine["shards"])
        out = {**base, "metadata": {**base["metadata"], **totals(shards, files)}, "shards": shards, "files": files}
        out.pop("snapshot", None)
        out["schema"] = _same_schema(self.target, base, shards)
        return out, 0, 0


def _same_schema(target: Any, base: dict, shards: dict) -> list:
    """The schema of ``shards``' groups, which must be ``base``'s: compaction never changes what a reader sees.

    ``base``'s was made from its groups with or without ``ragged=False``'s rule (`schema`'s ``fixed``);
    the compacted groups are its types, so one of the two rules gives it back.
    """
    layouts = {Layout.from_json(g) for entry in shards.values() for g in entry["groups"].values()}
    recorded = base.get("schema")
    tried = []
    for fixed in (False, True):
        types = [t.to_json() for t in schema(layouts, fixed=fixed)]
        if recorded is None or sorted(map(repr, types)) == sorted(map(repr, recorded)):
            return types
        tried.append(types)
    raise OutputError(
        f"{target!r}: the compacted shards' schema ({tried[0]!r:.200}) is not the dataset's ({recorded!r:.200}); "
        "nothing was committed"
    )


WHOLE_BYTES = 4 << 20  # in an object store, shards up to this size are read whole: one request, not one a segment


class _SmallShardsWhole:
    """``store``, whose shards of at most `WHOLE_BYTES` (``sizes``: a listing's) are opened by reading them whole.

    A compaction reads every segment of every shard; in an object store each read is a request, so a
    dataset of many small jobs' shards (thousands of segments) costs a request per segment without this.
    At most `tdgather.storage.reader.OPEN_SHARDS` shards are open (held) at once.
    """

    def __init__(self, store: Store, sizes: dict[str, int]) -> None:
        self._store, self._sizes = store, sizes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def open(self, name: str) -> Any:
        size = self._sizes.get(name)
        if self._store.atomic_rename or size is None or size > WHOLE_BYTES:  # mapped locally; big: ranges
            return self._store.open(name)
        return BytesSource(self._store.read(name), self._store.path(name))


class _Rows(NamedTuple):
    """One filename's frames, as the writer takes a gathered group (`tdgather.storage.shards.items_of`)."""

    layout: Layout
    files: list[str]
    starts: list[int]
    counts: list[int]
    frame_idx: torch.Tensor
    leaves: list
    json: list[list]


class _Batch(NamedTuple):
    groups: list[_Rows]


def _rows(ds: Dataset, name: str) -> _Rows:
    """``name``'s frames as ``ds`` reads them (its schema's type), ordered by frame_idx; no tree rebuilt."""
    layout, idx, tensors, json_values = ds.columns(name)
    return _Rows(layout, [name], [0], [idx.numel()], idx, tensors, json_values)


def compact(
    path: str | os.PathLike,
    storage_options: dict | None = None,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    store: Store | None = None,
) -> Snapshot:
    """Rewrite the newest snapshot's frames into fewer shards, committed as the next snapshot (the module's rules).

    Args:
        path: the dataset (a directory, or an object store URL).
        storage_options: for an object store URL, the filesystem's options (fsspec's).
        max_shard_bytes: the compacted shards' size, at most (a filename is never split).
        store: the store itself (a test's double); default the one ``path`` names.

    Returns:
        The snapshot the compaction committed (its ``compacted``: the snapshot it rewrote); where the
        newest snapshot is a compaction's (nothing committed since), that one: nothing is written.

    Raises:
        ValueError: ``max_shard_bytes`` is not an int >= 1.
        OutputError: no snapshot there; another compaction committed first (nothing committed).
        DatasetError: a shard of the snapshot is damaged (nothing committed).
    """
    if type(max_shard_bytes) is not int or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: expected an int >= 1, got {max_shard_bytes!r}")
    store = store or store_at(path, storage_options)
    numbers = snapshot_numbers(store)
    if not numbers:
        raise OutputError(f"{str(path)!r} holds no tdgather dataset (no snapshot and no index): nothing to compact")
    newest = snapshot_at(store, numbers[-1])
    if newest.compacted is not None:  # nothing was committed since the last compaction: nothing to do
        return newest
    ds = Dataset(path, store=_SmallShardsWhole(store, store.list()), version=numbers[-1])  # type: ignore[arg-type]
    out = CompactOutput(store, numbers[-1], ds.index)
    writer = DatasetWriter(path, output=out, max_shard_bytes=max_shard_bytes)
    try:
        batch: list[_Rows] = []
        size = 0
        for name in ds:
            if not ds.num_frames(name):
                continue
            rows = _rows(ds, name)
            batch.append(rows)
            size += frame_bytes(rows.layout, rows.frame_idx, rows.leaves)
            if size >= max_shard_bytes:
                writer.write(_Batch(batch))
                batch, size = [], 0
        if batch:
            writer.write(_Batch(batch))
        writer.commit()
    except BaseException:
        writer.discard()
        raise
    assert out.snapshot is not None
    return snapshot_at(store, out.snapshot)
