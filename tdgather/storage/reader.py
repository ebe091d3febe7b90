"""Stage 6, the reader: a lazy ``Mapping[str, Frames]`` over a saved dataset.

Reading one filename opens its shard(s) (`tdgather.format.codec.SafetensorsFile` over the
store's bytes: a mapped file, or byte ranges of an object) and slices only that filename's
rows; segments written at different times are merged by ``frame_idx``. Nothing on disk is
trusted (`tdgather.format.check`):
the index is checked whole at open, a shard's header each time the shard is
opened, JSON offsets and lines as they are read; anything malformed raises
`DatasetError`, and no path outside the dataset directory is ever opened.

A `Dataset` keeps the shards it opened open (up to `OPEN_SHARDS`, least recently
used closed first), so a read costs the same however many filenames the dataset
holds, and a handle keeps reading the files it opened after the dataset is
rewritten (``overwrite=True`` replaces files, never edits them). A shard opened
after a rewrite is another run's: its ``__metadata__.run`` differs from the
index's, and it is refused (`check_run`), never read under the old names.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..core.frames import Frames, Layout
from ..core.promote import promote_columns
from ..core.ragged import Ragged
from ..core.rebuild import rebuild
from ..errors import DatasetError, OutputError
from ..format.check import (
    Check,
    check_index,
    check_run,
    check_shard,
    index_run,
    key,
    load_json,
    shard_version,
)
from ..format.names import INCOMPLETE_NAME, INDEX_NAME, SNAPSHOT_NAME
from .location import store_at
from .outdir import staging_of
from .scan import loose_shards, partial_index
from .segments import OpenShard, cat_columns, nested, offsets_of_rows, open_shard, read_picked, read_rows
from .snapshots import index_name as snapshot_file
from .snapshots import snapshot_numbers
from .store import LocalStore, Store, digest
from .views import FrameDataset

__all__ = ["OPEN_SHARDS", "Dataset", "open_dataset"]

OPEN_SHARDS = 128  # shards a Dataset keeps open (mapped; no file descriptor stays open): least recently used go


class Dataset(Mapping[str, Frames]):
    """A saved dataset; ``ds[filename]`` reads that filename's frames from disk.

    Shards are opened on first use and kept open (`OPEN_SHARDS` at most); a handle opened before
    the dataset was rewritten (``overwrite=True``) keeps reading the shards it had open, and
    refuses, with a `DatasetError` naming the file, a shard it opens afterwards (another run's).
    Pickled (a spawned DataLoader worker), it leaves its open shards behind.

    Attributes:
        path: the dataset directory.
        index: the parsed ``tdgather.index.json``.
        metadata: totals and user metadata; for an incomplete dataset, ``metadata["failure"]``.
        schema: the types of frame the dataset holds (`Layout`s, usually one), as the index records
            them (index version 8 on; worked out from the groups for an older index): every
            filename's frames read as one of them (`layout`), so a leaf name has one type.
        ragged_leaves: the leaves (dotted keys) ragged in the schema.
    """

    # ``ds.to_hf(cache_dir=None, *, filenames=None)``, the frames as a Hugging Face dataset: the package
    # (tdgather/__init__.py) sets `tdgather.integrations.hf.to_hf` here; the storage layer imports no integration
    to_hf: Callable[..., Any]

    def __init__(
        self,
        path: str | os.PathLike,
        incomplete: bool = False,
        storage_options: dict | None = None,
        store: Store | None = None,
        tensorclass: bool = True,
        version: int | None = None,
    ) -> None:
        if incomplete and version is not None:
            raise ValueError("version= reads a committed snapshot; incomplete=True what a failed run saved: pass one")
        self.version = version  # the snapshot asked for (None: the newest)
        self.tensorclass = tensorclass  # False: every tree read as a TensorDict (`layout` names no class)
        store = store or store_at(path, storage_options)  # ``store``: the store itself (a test's, for a URL)
        self.store: Store = store
        self.path: Path | str = Path(store.where) if store.atomic_rename else store.where
        built = None
        if not store.atomic_rename:
            index_name = self._open_prefix(incomplete)
            built = self._built
        elif incomplete:
            self.path = self.path if self.path.name.endswith(".partial") else staging_of(self.path)
            self.store = store = LocalStore(self.path)
            index_name = INCOMPLETE_NAME
            built = partial_index(store) if self.path.is_dir() else None
            if built is None and store.size(INCOMPLETE_NAME) is None:
                raise OutputError(
                    f"{str(self.path)!r} holds no shards and no {INCOMPLETE_NAME}: no failed run saved anything there"
                )
        else:
            index_name = snapshot_file(store, version) or INDEX_NAME  # the newest snapshot, or the one asked for
            if store.size(index_name) is None:
                raise OutputError(
                    f"{str(self.path)!r} is not a complete tdgather dataset: no {INDEX_NAME}{_hint(self.path)}"
                )
        self._index = Check(self.store.path(index_name))
        self.index: dict[str, Any] = (
            built if built is not None else load_json(self.store.read(index_name), self._index, "index")
        )
        self._plan = check_index(self.index, self.store.path(index_name), incomplete)  # all of it, before any shard
        numbered = SNAPSHOT_NAME.fullmatch(index_name)  # a snapshot says which it is, as its name does
        if numbered and (self.index.get("snapshot") or {}).get("version") != int(numbered[1]):
            got = (self.index.get("snapshot") or {}).get("version")
            raise self._index.fail("snapshot.version", f"{int(numbered[1])}, the number in its name", got)
        self.metadata: dict[str, Any] = self.index["metadata"]
        self._files: dict[str, dict] = self.index["files"]
        self._run = index_run(self.index, self._index)  # every shard opened must be of this run
        self.schema: tuple[Layout, ...] = tuple(map(self._as_read, self._plan.schema))
        self.ragged_leaves = self._plan.ragged
        self._as_stored = all(t is k or t == k for k, t in self._plan.types.items())  # each group read as stored
        self._open: OrderedDict[str, OpenShard] = OrderedDict()  # by shard name, least recently used first
        self._lock = threading.Lock()

    def _open_prefix(self, incomplete: bool) -> str:
        """An object store prefix: its index, or (``incomplete``) the failed run's shards beside it."""
        self._built = None
        if incomplete:
            loose = loose_shards(self.store)
            self._built = partial_index(self.store, loose) if loose else None
            if self._built is None and self.store.size(INCOMPLETE_NAME) is None:
                raise OutputError(
                    f"{self.path!r} holds no shards of a failed run and no {INCOMPLETE_NAME}: no failed run saved "
                    "anything there"
                )
            return INCOMPLETE_NAME
        name = snapshot_file(self.store, self.version)
        if name is not None:
            return name
        if self.store.size(INDEX_NAME) is None:
            listing = self.store.list()
            hint = ""
            if INCOMPLETE_NAME in listing or loose_shards(self.store, listing):
                hint = (
                    "; it holds shards of a failed or unfinished run: tdgather.open(url, incomplete=True) reads them, "
                    "Collector(url, resume=True) continues it"
                )
            elif not listing:
                hint = " (nothing is stored under that prefix: check the URL and storage_options)"
            raise OutputError(f"{self.path!r} is not a complete tdgather dataset: no {INDEX_NAME}{hint}")
        return INDEX_NAME

    def __getstate__(self) -> dict:
        """Pickled (a spawned DataLoader worker) without open shards: the copy opens and checks its own."""
        state = self.__dict__.copy()
        del state["_open"], state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._files)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def layout(self, name: str) -> Layout:
        """The layout (structure, dtypes, per-frame shapes) of a filename, without reading data.

        It is one of the dataset's `schema`: a leaf ragged in any filename of the dataset is ragged
        here too (`ragged_leaves`), so a leaf name has one type across the dataset: frames stored
        fixed read as that many rows each. Opened with ``tensorclass=False``, it names no
        tensorclass: frames are read as TensorDicts.
        """
        stored = self._plan.layouts[name]
        return self._as_read(stored if self._as_stored else self._plan.types[stored])

    def _as_read(self, layout: Layout) -> Layout:
        """``layout`` as frames are read: without its tensorclass when opened with ``tensorclass=False``."""
        return layout if self.tensorclass or layout.cls is None else replace(layout, cls=None)

    def stored_layout(self, name: str) -> Layout:
        """A filename's layout as its segments have it: joined where they differ in a leaf's first dim.

        A leaf stored fixed in one segment and with another first dim (or ragged) in another is
        ragged here; the index's groups say how each segment is stored. Leaves ragged only in other
        filenames are not made ragged here (as `layout` makes them).
        """
        return self._plan.layouts[name]

    def read_rows(self, shard: OpenShard, group: str, name: str, lo: int, hi: int) -> tuple[torch.Tensor, list, list]:
        """Rows ``lo:hi`` of one of ``name``'s segments, as `layout` gives them (fixed leaves made ragged)."""
        stored = self._plan.groups[shard.shard, group]
        idx, tensors, json_values = read_rows(shard.f, shard.c, shard.names(group, stored), stored, lo, hi)
        return idx, self._promoted(stored, name, tensors), json_values

    def read_picked(
        self, shard: OpenShard, group: str, name: str, rows: torch.Tensor
    ) -> tuple[torch.Tensor, list, list]:
        """Rows ``rows`` (any order) of a group that holds ``name``'s frames, as `layout` gives ``name``'s frames.

        One gather per tensor where the shard is mapped, one read per run of consecutive rows where
        not (`tdgather.storage.segments.read_picked`); the rows must lie in the group's segments.
        """
        stored = self._plan.groups[shard.shard, group]
        idx, tensors, json_values = read_picked(shard.f, shard.c, shard.names(group, stored), stored, rows)
        return idx, self._promoted(stored, name, tensors), json_values

    def _promoted(self, stored: Layout, name: str, tensors: list) -> list:
        layout = self.layout(name)
        return tensors if layout is stored or layout == stored else promote_columns(stored, layout, tensors)

    def num_frames(self, name: str) -> int:
        """Frames stored for a filename, without reading data."""
        return self._files[name]["frames"]

    def lengths(self, name: str) -> dict[str, torch.Tensor]:
        """Per ragged leaf (dotted key), each frame's rows, in frame order; reads only the offsets."""
        layout, out = self.layout(name), {}
        ragged = [j for j, leaf in enumerate(layout.leaves) if leaf.ragged]
        if not ragged:
            return out
        idx, per_leaf = [], {j: [] for j in ragged}
        for shard, group, lo, hi in self.segments(name):
            stored = self._plan.groups[shard.shard, group]
            names = shard.names(group, stored)
            idx.append(shard.f.get_slice(names.frame_idx)[lo:hi])
            for j in ragged:
                if stored.leaves[j].ragged:
                    lengths = offsets_of_rows(shard.f, shard.c, names, names.leaves[j], lo, hi)[0].diff()
                else:  # stored fixed: each frame has its first dim of rows
                    lengths = torch.full((hi - lo,), stored.leaves[j].shape[0], dtype=torch.int64)
                per_leaf[j].append(lengths)
        order = torch.argsort(torch.cat(idx))
        for j in ragged:
            out[".".join(layout.leaves[j].path) or "<tensor>"] = torch.cat(per_leaf[j])[order]
        return out

    def per_frame(self) -> Any:
        """The frames as a map-style ``torch.utils.data.Dataset``, one item a frame (`tdgather.storage.views`)."""
        return FrameDataset(self)

    def verify(self, checksums: bool = True) -> int:
        """Check every shard now: its header and size against the index, and (``checksums``) every byte.

        `__getitem__` checks headers lazily, per shard; only the checksums read every byte. The
        index lists each shard's checksum as it was written: its sha256 in an object store, its
        CRC-32 in a local directory (index version 7 on). Shards listed without one (an older
        tdgather's local dataset, or a failed run's shards that no record lists) get their header
        and size checked only. Returns the shards whose content was checked: fewer than
        ``len(index["shards"])`` means the others' content could not be (`tdgather inspect --verify`
        then exits 1).

        Raises:
            DatasetError: a shard missing, malformed, or changed since it was written (naming it).
        """
        checked = 0
        for shard, entry in self.index["shards"].items():
            self.shard(shard, f"shards[{shard!r}]")
            c = Check(self.store.path(shard))
            size = self.store.size(shard)
            if "size" in entry and size != entry["size"]:
                raise c.fail("size", f"{entry['size']} bytes, as the index records (the file changed since)", size)
            if not checksums or not {"sha256", "crc32"} & set(entry):
                continue
            got = digest(self.store, shard, sha256="sha256" in entry)
            changed = "as the index records (the file changed since it was written)"
            if "sha256" in entry and got.sha256 != entry["sha256"]:
                raise c.fail("sha256", f"sha256 {entry['sha256']}, {changed}", got.sha256)
            if "crc32" in entry and got.crc32 != entry["crc32"]:
                raise c.fail("crc32", f"CRC-32 {entry['crc32']}, {changed}", got.crc32)
            checked += 1
        return checked

    def shard(self, shard: str, field: str = "shards") -> OpenShard:
        """A shard of the index, open and checked (``field``: the index field that names it, for errors).

        Opened once and kept (`OPEN_SHARDS` at most). Each open checks the header against the index
        (`check_shard`) and that the file is of the run the index lists (`check_run`): a file
        replaced since the dataset was opened (by ``save(..., overwrite=True)``) raises `DatasetError`;
        a shard opened before keeps giving what it held then.
        """
        with self._lock:
            got = self._open.get(shard)
            if got is not None:
                self._open.move_to_end(shard)
                return got
        try:
            f = open_shard(self.store, shard, self._index, field)
        except DatasetError as e:
            raise self._expired(shard) or e from e
        c = Check(self.store.path(shard))
        check_run(f, c, self._run, shard)
        check_shard(f, c, shard, self.index["shards"][shard]["groups"], self._plan, self._index)
        opened = OpenShard(f, c, shard_version(f, c), shard)
        with self._lock:
            self._open[shard] = opened
            while len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)
        return opened

    def _expired(self, shard: str) -> OutputError | None:
        """Where ``shard`` is gone because this snapshot expired (`tdgather.storage.expire`): the error that says so."""
        mine = (self.index.get("snapshot") or {}).get("version", 0)
        numbers = snapshot_numbers(self.store)
        if self.store.size(shard) is not None or not numbers or numbers[-1] <= mine:
            return None  # the newest snapshot, or no snapshots: a shard missing from it is damage
        return OutputError(
            f"{str(self.path)!r}: shard {shard} of snapshot {mine}, which this Dataset reads, is gone: snapshot "
            f"{mine} was superseded, then expired (tdgather.expire removes what only expired snapshots list). Open "
            f"the dataset again: tdgather.open(path) reads the newest snapshot, {numbers[-1]}"
        )

    def segments(self, name: str, only: int | None = None) -> Iterator[tuple[OpenShard, str, int, int]]:
        """Each segment of ``name`` (or only segment ``only``): its open shard, group, and rows ``lo, hi``."""
        segments = self._files[name]["segments"]
        for i in range(len(segments)) if only is None else range(only, min(only + 1, len(segments))):
            segment = segments[i]
            shard = self.shard(segment["shard"], f"files{key(name)}.segments[{i}].shard")
            yield shard, segment["group"], segment["start"], segment["start"] + segment["frames"]

    def columns(self, name: str) -> tuple[Layout, torch.Tensor, list, list]:
        """``name``'s frames as columns, no tree rebuilt: its `layout`, frame_idx, tensor leaves and JSON leaves.

        Its segments are read and merged by frame_idx (ragged leaves as `Ragged` columns).

        Raises:
            DatasetError: a frame there twice, or a segment's frames out of order.
        """
        entry = self._files[name]
        layout = self.layout(name)
        pieces = [self.read_rows(s, group, name, lo, hi) for s, group, lo, hi in self.segments(name)]
        idx, tensors, json_values = pieces[0]
        if len(pieces) > 1:  # segments written at different times: merge them by frame_idx
            order = torch.argsort(torch.cat([p[0] for p in pieces]))
            idx = torch.cat([p[0] for p in pieces])[order]
            tensors = [cat_columns([p[1][j] for p in pieces]).index_select(0, order) for j in range(len(layout.leaves))]
            rows = order.tolist()
            json_values = [[v for p in pieces for v in p[2][j]] for j in range(len(layout.nontensor))]
            json_values = [[values[r] for r in rows] for values in json_values]
        count = idx.numel()
        if count > 1 and not bool((idx[1:] > idx[:-1]).all()):  # each frame once, in order: as tdgather writes
            at = int((idx[1:] <= idx[:-1]).nonzero()[0]) + 1
            shards = ", ".join(sorted({segment["shard"] for segment in entry["segments"]}))
            expected = f"strictly increasing indices, each frame once (rows {at - 1} and {at})"
            raise Check(self.store.path(shards)).fail(
                f"files{key(name)} frame_idx", expected, idx[at - 1 : at + 1].tolist()
            )
        return layout, idx, tensors, json_values

    def __getitem__(self, name: str) -> Frames:
        layout, idx, tensors, json_values = self.columns(name)
        count = idx.numel()
        tensors = [nested(t) if isinstance(t, Ragged) else t for t in tensors]  # as `rebuild` would, sooner
        try:
            value = rebuild(layout, count, tensors, json_values)
        except (KeyError, ValueError, TypeError) as e:  # leaves that do not make it
            raise self._index.fail(f"files{key(name)}", f"leaves that make {layout.describe()}", str(e)) from e
        return Frames._of(idx, value)


def _hint(path: Path) -> str:
    """What ``<path>.partial`` holds, where a dataset has no index: how to read or continue it."""
    partial = staging_of(path)
    if (partial / INCOMPLETE_NAME).exists():
        return (
            f"; a failed run saved frames in {str(partial)!r}: tdgather.open(path, incomplete=True) "
            "reads them (tdgather inspect --incomplete PATH lists them)"
        )
    if (partial / INDEX_NAME).exists():
        return f"; {str(partial)!r} holds a complete dataset whose move into place was interrupted"
    if partial.exists():
        return (
            f"; {str(partial)!r} holds shards of an interrupted run: tdgather.open(path, incomplete=True) "
            "reads them, Collector(path, resume=True) continues it"
        )
    return ""


def open_dataset(
    path: str | os.PathLike,
    *,
    incomplete: bool = False,
    storage_options: dict | None = None,
    tensorclass: bool = True,
    version: int | None = None,
) -> Dataset:
    """Open a saved dataset lazily; raises OutputError when it is incomplete, DatasetError when it is malformed.

    The index is checked whole here; each shard's header the first time one of its filenames
    is read. ``path`` may be an object store URL, with fsspec's ``storage_options``. With
    ``incomplete=True``, open instead what a failed run saved in ``<path>.partial`` (under a URL: its
    objects beside any old dataset)
    (the frames committed before the failure, listed in ``tdgather.incomplete.json``).
    ``tensorclass=False`` reads every frame of a tensorclass as a TensorDict of its fields; by
    default it is that class where this process has imported it with those fields, and a
    TensorDict, with a warning that names the class and why, where not.

    A dataset that jobs append to (``append=True``) is read at its newest snapshot, which is
    always whole, also while other jobs commit; ``version=n`` reads snapshot n as it was committed
    (`tdgather.snapshots` lists them; 0 is the dataset written before any job appended).
    """
    return Dataset(path, incomplete, storage_options, tensorclass=tensorclass, version=version)
