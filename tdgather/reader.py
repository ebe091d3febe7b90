"""Stage 6, the reader: a lazy ``Mapping[str, Frames]`` over a saved dataset.

Reading one filename opens its shard(s) with ``safetensors.safe_open`` and
slices only that filename's rows; segments written at different times are
merged by ``frame_idx``. Nothing on disk is trusted (`tdgather._index_check`):
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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._index_check import (
    Check,
    check_group,
    check_index,
    check_layout,
    check_run,
    check_segment,
    check_shard,
    index_run,
    json_scalar,
    key,
    load_json,
    names_in,
    open_shard,
    shard_groups,
    shard_version,
)
from ._names import GroupNames, group_names
from ._output import INCOMPLETE_NAME, INDEX_NAME
from .errors import DatasetError, OutputError
from .frames import Frames, Layout, rebuild
from .ragged import Ragged

__all__ = ["OPEN_SHARDS", "Dataset", "OpenShard", "open_dataset", "read_segment"]

OPEN_SHARDS = 128  # shards a Dataset keeps open (mapped; no file descriptor stays open): least recently used go


@dataclass
class OpenShard:
    """A shard a `Dataset` opened and checked: the ``safe_open`` handle, and its tensor names per group.

    The handle maps the file as it was when opened: it keeps reading those bytes after the path is
    replaced or removed.

    Attributes:
        f: the ``safe_open`` handle.
        c: the shard file's `Check` (errors name the file).
        version: the tensor names' version (`tdgather._names`), from its ``__metadata__``.
    """

    f: Any
    c: Check
    version: int
    _names: dict = field(default_factory=dict, init=False, repr=False)

    def names(self, group: str, layout: Layout) -> GroupNames:
        """The tensor names of ``group`` read with ``layout`` (cached)."""
        got = self._names.get((group, layout))
        if got is None:
            got = self._names[group, layout] = group_names(group, layout, self.version)
        return got


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
    """

    def __init__(self, path: str | os.PathLike, incomplete: bool = False) -> None:
        self.path = Path(path)
        partial = self.path.with_name(self.path.name + ".partial")
        built = None
        if incomplete:
            if not self.path.name.endswith(".partial"):
                self.path = partial
            index_path = self.path / INCOMPLETE_NAME
            from .resume import partial_index  # the shards' own records: also after a killed rank dst

            built = partial_index(self.path) if self.path.is_dir() else None
            if built is None and not index_path.is_file():
                raise OutputError(
                    f"{str(self.path)!r} holds no shards and no {INCOMPLETE_NAME}: no failed run saved anything there"
                )
        else:
            index_path = self.path / INDEX_NAME
        if built is None and not index_path.is_file():
            hint = ""
            if (partial / INCOMPLETE_NAME).exists():
                hint = (
                    f"; a failed run saved frames in {str(partial)!r}: tdgather.open(path, incomplete=True) "
                    "reads them (tdgather inspect --incomplete PATH lists them)"
                )
            elif (partial / INDEX_NAME).exists():
                hint = f"; {str(partial)!r} holds a complete dataset whose move into place was interrupted"
            elif partial.exists():
                hint = (
                    f"; {str(partial)!r} holds shards of an interrupted run: tdgather.open(path, incomplete=True) "
                    "reads them, Collector(path, resume=True) continues it"
                )
            raise OutputError(f"{str(self.path)!r} is not a complete tdgather dataset: no {INDEX_NAME}{hint}")
        self._index = Check(index_path)
        if built is not None:
            self.index: dict[str, Any] = built
        else:
            if os.path.dirname(os.path.realpath(index_path)) != os.path.realpath(self.path):
                raise DatasetError(str(index_path), "file", "expected a file in the dataset directory, got a link out")
            self.index = load_json(index_path.read_bytes(), self._index, "index")
        self._plan = check_index(self.index, str(index_path), incomplete)  # all of it, before any shard
        self.metadata: dict[str, Any] = self.index["metadata"]
        self._files: dict[str, dict] = self.index["files"]
        self._run = index_run(self.index, self._index)  # every shard opened must be of this run
        self._open: OrderedDict[str, OpenShard] = OrderedDict()  # by shard name, least recently used first
        self._lock = threading.Lock()

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
        """The layout (structure, dtypes, per-frame shapes) of a filename, without reading data."""
        return self._plan.layouts[name]

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
        for shard, group, lo, hi in self._segments(name):
            names = shard.names(group, layout)
            idx.append(shard.f.get_slice(names.frame_idx)[lo:hi])
            for j in ragged:
                per_leaf[j].append(_offsets(shard.f, shard.c, names, names.leaves[j], lo, hi)[0].diff())
        order = torch.argsort(torch.cat(idx))
        for j in ragged:
            out[".".join(layout.leaves[j].path) or "<tensor>"] = torch.cat(per_leaf[j])[order]
        return out

    def per_frame(self) -> Any:
        """The frames as a map-style ``torch.utils.data.Dataset``, one item a frame (`tdgather.views.FrameDataset`)."""
        from .views import FrameDataset

        return FrameDataset(self)

    def to_hf(self, **kwargs: Any) -> Any:
        """The frames as a Hugging Face ``datasets.Dataset``, one row a frame (`tdgather.views.to_hf`; extra ``hf``)."""
        from .views import to_hf

        return to_hf(self, **kwargs)

    def verify(self) -> None:
        """Check every shard's header against the index now (`__getitem__` does it lazily, per shard)."""
        for shard in self.index["shards"]:
            self.shard(shard, f"shards[{shard!r}]")

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
        f = open_shard(self.path, shard, self._index, field)
        c = Check(self.path / shard)
        check_run(f, c, self._run)
        check_shard(f, c, shard, self.index["shards"][shard]["groups"], self._plan, self._index)
        opened = OpenShard(f, c, shard_version(f, c))
        with self._lock:
            self._open[shard] = opened
            while len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)
        return opened

    def _segments(self, name: str, only: int | None = None) -> Iterator[tuple[OpenShard, str, int, int]]:
        """Each segment of ``name`` (or only segment ``only``): its open shard, group, and rows ``lo, hi``."""
        segments = self._files[name]["segments"]
        for i in range(len(segments)) if only is None else range(only, min(only + 1, len(segments))):
            segment = segments[i]
            shard = self.shard(segment["shard"], f"files{key(name)}.segments[{i}].shard")
            yield shard, segment["group"], segment["start"], segment["start"] + segment["frames"]

    def __getitem__(self, name: str) -> Frames:
        entry = self._files[name]
        layout = self.layout(name)
        pieces = [_rows(s.f, s.c, s.names(group, layout), layout, lo, hi) for s, group, lo, hi in self._segments(name)]
        idx, tensors, json_values = pieces[0]
        if len(pieces) > 1:  # segments written at different times: merge them by frame_idx
            order = torch.argsort(torch.cat([p[0] for p in pieces]))
            idx = torch.cat([p[0] for p in pieces])[order]
            tensors = [_cat([p[1][j] for p in pieces]).index_select(0, order) for j in range(len(layout.leaves))]
            rows = order.tolist()
            json_values = [[v for p in pieces for v in p[2][j]] for j in range(len(layout.nontensor))]
            json_values = [[values[r] for r in rows] for values in json_values]
        count = idx.numel()
        if count > 1 and not bool((idx[1:] > idx[:-1]).all()):  # each frame once, in order: as tdgather writes
            at = int((idx[1:] <= idx[:-1]).nonzero()[0]) + 1
            shards = ", ".join(sorted({segment["shard"] for segment in entry["segments"]}))
            expected = f"strictly increasing indices, each frame once (rows {at - 1} and {at})"
            raise Check(self.path / shards).fail(f"files{key(name)} frame_idx", expected, idx[at - 1 : at + 1].tolist())
        try:
            value = rebuild(layout, count, tensors, json_values)
        except (KeyError, ValueError, TypeError) as e:  # e.g. a loaded tensorclass whose fields differ
            raise self._index.fail(f"files{key(name)}", f"leaves that make {layout.describe()}", str(e)) from e
        return Frames(frame_idx=idx, frames=value, batch_size=[count])


def read_segment(root: str | os.PathLike, segment: dict, layout: Layout) -> tuple[torch.Tensor, list, list]:
    """Read one segment's ``(frame_idx, tensor leaves, JSON leaves)``, touching only its rows.

    The segment, the shard's path and header, and the group's tensors are checked against
    ``layout`` first; a malformed one raises `DatasetError`.
    """
    root = Path(root)
    c = Check(root)
    shard, group, lo, count = check_segment(segment, c, "segment")
    s = Check(root / shard)
    with open_shard(root, shard, c, "segment.shard") as f:
        desc = shard_groups(f, s).get(group)
        if desc is None or check_layout(desc, s, f"__metadata__.groups[{group!r}]") != layout:
            raise s.fail(f"__metadata__.groups[{group!r}]", layout.describe(), desc)
        n = check_group(f, s, group, layout)
        if lo + count > n:
            raise c.fail("segment", f"start + frames <= {n}, the rows of {group} in {shard}", lo + count)
        return _rows(f, s, names_in(f, s, group, layout), layout, lo, lo + count)


def _cat(columns: list) -> Any:
    return Ragged.cat(columns) if isinstance(columns[0], Ragged) else torch.cat(columns)


def _offsets(f: Any, c: Check, names: GroupNames, name: str, lo: int, hi: int) -> tuple[torch.Tensor, Any]:
    """The offsets of rows ``lo:hi`` of a blob (a ragged leaf's values, JSON lines), and the blob, unread.

    The offsets are checked (non-decreasing, inside the blob) before anything else is read.
    """
    offsets_name = names.offsets(name)
    offsets = f.get_slice(offsets_name)[lo : hi + 1]
    blob = f.get_slice(name)
    size = blob.get_shape()[0]
    if bool((offsets.diff() < 0).any()) or int(offsets.min()) < 0 or int(offsets.max()) > size:
        raise c.fail(offsets_name, f"non-decreasing offsets in 0..{size} (rows {lo}..{hi})", offsets.tolist()[:20])
    return offsets, blob


def _span(f: Any, c: Check, names: GroupNames, name: str, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``lo:hi`` of a blob with offsets, read once their offsets are checked; and the offsets."""
    offsets, blob = _offsets(f, c, names, name, lo, hi)
    return offsets, blob[int(offsets[0]) : int(offsets[-1])]


def _own(t: torch.Tensor) -> torch.Tensor:
    """Rows read, in memory of their own where they are a small part of the tensor they come from.

    safetensors' slices view the whole tensor's mapping: kept, they keep it alive, and pickled (a
    DataLoader worker's result) they would take the whole tensor with them.
    """
    return t.clone() if t.untyped_storage().nbytes() > 2 * t.nbytes + 4096 else t


def _rows(f: Any, c: Check, names: GroupNames, layout: Layout, lo: int, hi: int) -> tuple[torch.Tensor, list, list]:
    """Rows ``lo:hi`` of a group (its tensor ``names``) whose header is checked; offsets, JSON lines checked as read."""
    idx = _own(f.get_slice(names.frame_idx)[lo:hi])
    tensors: list[Any] = []
    for name, leaf in zip(names.leaves, layout.leaves, strict=True):
        if leaf.ragged:
            offsets, values = _span(f, c, names, name, lo, hi)
            tensors.append(Ragged(_own(values), offsets - offsets[0]))
        else:
            tensors.append(_own(f.get_slice(name)[lo:hi]))
    json_values = []
    for name in names.json:
        offsets, blob = _span(f, c, names, name, lo, hi)
        bounds = offsets.tolist()
        data = blob.numpy().tobytes()
        at = [b - bounds[0] for b in bounds]
        lines = (data[a:b] for a, b in zip(at, at[1:], strict=False))
        json_values.append([json_scalar(line, c, f"{name} row {lo + r}") for r, line in enumerate(lines)])
    return idx, tensors, json_values


def open_dataset(path: str | os.PathLike, *, incomplete: bool = False) -> Dataset:
    """Open a saved dataset lazily; raises OutputError when it is incomplete, DatasetError when it is malformed.

    The index is checked whole here; each shard's header the first time one of its filenames
    is read. With ``incomplete=True``, open instead what a failed run saved in ``<path>.partial``
    (the frames committed before the failure, listed in ``tdgather.incomplete.json``).
    """
    return Dataset(path, incomplete)
