"""Other views of a saved dataset: one item per frame, for a DataLoader.

`FrameDataset` is a map-style ``torch.utils.data.Dataset`` over every frame of every filename
(filenames sorted, frames by ``frame_idx``). It reads each group's ``frame_idx`` column once, at
construction (vectorised: no per-filename work beyond listing its segments), and then each item
reads only its own frame's rows, through the `tdgather.Dataset`'s open shards. Those are checked
like any read: a shard rewritten by another run is refused, never read under the old names.
DataLoader workers can share it: forked, they keep the shards already open; pickled (spawn),
they open and check their own.

A DataLoader with a ``batch_size`` asks for a batch's items at once (``__getitems__``): they are
read together, one gather per tensor of each group the batch touches (`FrameBatch`), and
`collate_frames` makes them one value of ``B`` frames (a leaf one tensor), so that a worker's
batch crosses to the main process as a few tensors, not one per frame.

The reader makes these views of itself (``Dataset.per_frame``), so this module does not import
it: a view reads through what `FrameSource` names. `column_label` names a leaf's column here, in
``tdgather inspect`` and in the Hugging Face export (`tdgather.integrations.hf`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.utils.data

from ..core.frames import Layout
from ..core.ragged import Ragged
from ..core.rebuild import rebuild, rebuild_one
from ..errors import DatasetError
from ..format.check import key
from ..format.names import escape_key
from .segments import OpenShard, cat_columns, nested

__all__ = ["FrameBatch", "FrameDataset", "FrameSource", "collate_frames", "column_label", "frame_ranges"]

TENSOR_COLUMN = "frames"  # the column of a filename whose frames are plain tensors (no keys)


class FrameSource(Protocol):
    """What a view reads a dataset through: a `tdgather.Dataset` (`tdgather.storage.reader`) is one."""

    path: Path | str
    index: dict[str, Any]

    def __iter__(self) -> Iterator[str]:
        """The filenames."""

    def layout(self, name: str) -> Layout:
        """A filename's layout, as its frames are read."""

    def stored_layout(self, name: str) -> Layout:
        """A filename's layout as its segments store it."""

    def shard(self, shard: str, field: str = "shards") -> OpenShard:
        """A shard of the index, open and checked."""

    def segments(self, name: str, only: int | None = None) -> Iterator[tuple[OpenShard, str, int, int]]:
        """Each segment of ``name`` (or only segment ``only``): its open shard, group, and rows ``lo, hi``."""

    def read_rows(self, shard: OpenShard, group: str, name: str, lo: int, hi: int) -> tuple[torch.Tensor, list, list]:
        """Rows ``lo:hi`` of one of ``name``'s segments, as `layout` gives them."""

    def read_picked(
        self, shard: OpenShard, group: str, name: str, rows: torch.Tensor
    ) -> tuple[torch.Tensor, list, list]:
        """Rows ``rows`` (any order) of a group that holds ``name``'s frames, as `layout` gives them."""


def _frame_idx_only(layout: Layout) -> Layout:
    """A layout with no leaves: `read_rows` then reads a segment's frame indexes and nothing else."""
    return Layout(layout.kind, layout.cls, ())


class FrameDataset(torch.utils.data.Dataset):
    """Every frame of a saved dataset as one item: ``{"filename", "frame_idx", "frames"}``.

    Items are plain dicts, so the default collate (with ``batch_size=None``) and
    `collate_frames` both take them; ``frames`` is what ``tdgather.open(path)[filename][k].frames``
    gives: a tensor, or a TensorDict / tensorclass with batch size ``[]``, where a ragged leaf is
    that frame's ``[N_k, ...]`` rows. Order: filenames sorted, then frames by ``frame_idx``.

    Construction reads each group's ``frame_idx`` (nothing else); an item reads only its
    frame's rows (through the dataset's open shards, never their other rows), and a batch of
    items (``__getitems__``, which a DataLoader with a ``batch_size`` calls) only theirs, read
    together. It can be forked or pickled into DataLoader workers (a pickled copy opens its
    shards again, and checks them).

    Attributes:
        dataset: the `tdgather.Dataset`.
        filenames: the filenames, sorted.
    """

    def __init__(self, dataset: FrameSource) -> None:
        self.dataset = dataset
        self.filenames: list[str] = sorted(dataset)
        file_of, self._segment, self._row, self._frame_idx = _frame_map(dataset, self.filenames)
        counts = torch.bincount(file_of, minlength=len(self.filenames))
        self._starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _position(self, i: Any) -> int:
        """``i`` as a position in ``[0, len)``; IndexError outside ``[-len, len)``, TypeError for a non-integer."""
        if isinstance(i, bool) or not isinstance(i, int | torch.Tensor) and not hasattr(i, "__index__"):
            raise TypeError(f"FrameDataset items are taken by an integer position, got {type(i).__name__} {i!r:.40}")
        i, n = operator.index(i), len(self)
        if not -n <= i < n:
            raise IndexError(f"item {i} out of range for {n} frames")
        return i % n

    def locate(self, i: int) -> tuple[str, int]:
        """Item ``i``'s ``(filename, frame_idx)``, without reading data."""
        i = self._position(i)
        f = int(torch.searchsorted(self._starts, i, right=True)) - 1
        return self.filenames[f], int(self._frame_idx[i])

    def __getitem__(self, i: int) -> dict[str, Any]:
        i = self._position(i)
        name = self.filenames[int(torch.searchsorted(self._starts, i, right=True)) - 1]
        expected, segment, row = int(self._frame_idx[i]), int(self._segment[i]), int(self._row[i])
        shard, group, lo, hi = self._segment_of(name, segment)
        if not lo <= row < hi:
            raise shard.c.fail(f"{group} rows", f"row {row} inside {lo}..{hi}", "a segment changed since it was read")
        idx, tensors, json_values = self.dataset.read_rows(shard, group, name, row, row + 1)
        if idx.tolist() != [expected]:
            raise shard.c.fail(f"{group} frame_idx row {row}", f"[{expected}] (as read at construction)", idx.tolist())
        return {
            "filename": name,
            "frame_idx": expected,
            "frames": rebuild_one(self.dataset.layout(name), tensors, json_values),
        }

    def __getitems__(self, indices: Sequence[int]) -> FrameBatch:
        """Items ``indices`` (a DataLoader's batch), read together: a `FrameBatch`, a sequence of the items.

        The frames of each group the batch touches are read at once (`tdgather.Dataset.read_picked`:
        one gather per tensor of a mapped shard, one read per run of consecutive rows of another),
        each checked as `__getitem__` checks an item. `collate_frames` makes the batch one value.
        """
        return self._read([self._position(i) for i in indices])

    def _read(self, positions: list[int]) -> FrameBatch:
        """The items at ``positions`` (each in ``[0, len)``), read a group at a time."""
        at = torch.tensor(positions, dtype=torch.int64)
        files = (torch.searchsorted(self._starts, at, right=True) - 1).tolist()
        segments, rows, expected = self._segment[at].tolist(), self._row[at].tolist(), self._frame_idx[at]
        seen: dict[tuple[int, int], tuple] = {}  # (file, segment) -> its bucket's key, shard, group, lo, hi
        buckets: dict[tuple, list] = {}  # (shard, group, layout) -> [shard, name, group, positions in the batch]
        for k, (f, segment, row) in enumerate(zip(files, segments, rows, strict=True)):
            got = seen.get((f, segment))
            if got is None:
                name = self.filenames[f]
                shard, group, lo, hi = self._segment_of(name, segment)
                layout = self.dataset.layout(name)
                got = seen[f, segment] = ((shard.shard, group, layout), shard, group, lo, hi, name)
            bucket, shard, group, lo, hi, name = got
            if not lo <= row < hi:
                raise shard.c.fail(
                    f"{group} rows", f"row {row} inside {lo}..{hi}", "a segment changed since it was read"
                )
            buckets.setdefault(bucket, [shard, name, group, []])[3].append(k)
        parts = []
        for (_, _, layout), (shard, name, group, ks) in buckets.items():
            picked = torch.tensor([rows[k] for k in ks], dtype=torch.int64)
            idx, tensors, json_values = self.dataset.read_picked(shard, group, name, picked)
            want = expected[ks] if len(ks) < len(positions) else expected
            if idx.shape != want.shape or not torch.equal(idx.to(torch.int64), want):
                m = next(m for m in range(len(ks)) if m >= idx.numel() or int(idx[m]) != int(want[m]))
                raise shard.c.fail(
                    f"{group} frame_idx row {rows[ks[m]]}",
                    f"[{int(want[m])}] (as read at construction)",
                    idx[m : m + 1].tolist(),
                )
            parts.append((layout, ks, tensors, json_values))
        names = [self.filenames[f] for f in files]
        if len({layout for layout, *_ in parts}) == 1:  # one layout: the batch's columns
            layout, _, tensors, json_values = parts[0]
            if len(parts) > 1:  # groups in turn: joined, then put in the batch's order
                order = torch.argsort(torch.tensor([k for _, ks, _, _ in parts for k in ks]))
                tensors = [cat_columns([p[2][j] for p in parts]).index_select(0, order) for j in range(len(tensors))]
                picks = order.tolist()
                json_values = [[v for p in parts for v in p[3][j]] for j in range(len(json_values))]
                json_values = [[values[k] for k in picks] for values in json_values]
            return FrameBatch(names, expected, layout, tensors, json_values)
        values: list[Any] = [None] * len(positions)  # layouts differ: each frame on its own
        for layout, ks, tensors, json_values in parts:
            for m, k in enumerate(ks):
                values[k] = _one(layout, tensors, json_values, m)
        return FrameBatch(names, expected, None, values, [])

    def _segment_of(self, name: str, segment: int) -> tuple[OpenShard, str, int, int]:
        """Segment ``segment`` of ``name``: its open shard, group, and rows ``lo, hi``."""
        for got in self.dataset.segments(name, only=segment):
            return got
        raise DatasetError(str(self.dataset.path), f"files[{name!r}]", f"expected segment {segment}, got none")


def _one(layout: Layout, tensors: list, json_values: list, m: int) -> Any:
    """Frame ``m`` of columns of ``layout``: its value as `FrameDataset` items give it."""
    return rebuild_one(layout, [t[m : m + 1] for t in tensors], [values[m : m + 1] for values in json_values])


class FrameBatch(Sequence[dict[str, Any]]):
    """The items of a batch (`FrameDataset.__getitems__`), read together: a sequence of item dicts.

    An item is built when it is asked for; `collate_frames` takes the batch's columns directly
    (`collate`), so a DataLoader's batch never makes one. Where its frames differ in layout
    (filenames saved with other leaves), each frame was built on its own.

    Attributes:
        filenames: each frame's filename.
        frame_idx: LongTensor ``[B]``, each frame's index.
        layout: the frames' layout, or None where they differ.
    """

    def __init__(
        self, filenames: list[str], frame_idx: torch.Tensor, layout: Layout | None, tensors: list, json_values: list
    ) -> None:
        self.filenames, self.frame_idx, self.layout = filenames, frame_idx, layout
        self._tensors, self._json = tensors, json_values  # the columns; or (layout None) each frame's value
        self._items: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.filenames)

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        k = operator.index(k)
        if not -len(self) <= k < len(self):
            raise IndexError(f"item {k} out of range for a batch of {len(self)}")
        k %= len(self)
        item = self._items.get(k)
        if item is None:
            value = self._tensors[k] if self.layout is None else _one(self.layout, self._tensors, self._json, k)
            item = self._items[k] = {
                "filename": self.filenames[k],
                "frame_idx": int(self.frame_idx[k]),
                "frames": value,
            }
        return item

    def collate(self) -> dict[str, Any]:
        """The batch as `collate_frames` gives it: ``frames`` one value of the frames (a list where layouts differ)."""
        if self.layout is None:
            frames: Any = list(self._tensors)
        else:
            tensors = [nested(t) if isinstance(t, Ragged) else t for t in self._tensors]
            frames = rebuild(self.layout, len(self), tensors, self._json)
        return {"filename": list(self.filenames), "frame_idx": self.frame_idx, "frames": frames}


def _frame_map(dataset: FrameSource, filenames: list[str]) -> tuple[torch.Tensor, ...]:
    """Every frame of ``filenames``, by filename then ``frame_idx``: its filename's position, segment, row, frame_idx.

    Each group's ``frame_idx`` column is read once; the rest is vectorised over all frames.

    Raises:
        DatasetError: a segment out of order, or a frame stored twice.
    """
    column_of: dict[tuple[str, str], int] = {}  # (shard, group) -> its column's number
    ends: list[int] = []  # per column, the rows its segments reach
    named_by: list[str] = []  # per column, the first filename with a segment in it
    seg_file, seg_number, seg_column, seg_start, seg_frames = [], [], [], [], []
    for position, name in enumerate(filenames):
        for k, segment in enumerate(dataset.index["files"][name]["segments"]):
            where = segment["shard"], segment["group"]
            column = column_of.setdefault(where, len(column_of))
            if column == len(ends):
                ends.append(0)
                named_by.append(name)
            ends[column] = max(ends[column], segment["start"] + segment["frames"])
            seg_file.append(position)
            seg_number.append(k)
            seg_column.append(column)
            seg_start.append(segment["start"])
            seg_frames.append(segment["frames"])
    if not seg_file:
        return tuple(torch.zeros(0, dtype=dt) for dt in (torch.int64, torch.int32, torch.int64, torch.int64))
    columns, shards = [], []
    for (shard_name, group), end, name in zip(column_of, ends, named_by, strict=True):
        shard = dataset.shard(shard_name, f"shards[{shard_name!r}]")
        # the group's layout less its leaves: the stored layout of any of its filenames promotes it (same kind, cls)
        names = shard.names(group, _frame_idx_only(dataset.stored_layout(name)))
        columns.append(shard.f.get_slice(names.frame_idx)[:end])  # the header check made sure it has them
        shards.append(shard)
    counts = torch.tensor(seg_frames, dtype=torch.int64)
    seg_of = torch.repeat_interleave(torch.arange(len(seg_frames)), counts)  # each frame's segment
    first = counts.cumsum(0) - counts
    row = torch.tensor(seg_start, dtype=torch.int64)[seg_of] + torch.arange(seg_of.numel()) - first[seg_of]
    base = torch.tensor([0] + [c.numel() for c in columns[:-1]], dtype=torch.int64).cumsum(0)
    idx = torch.cat(columns).to(torch.int64)[base[torch.tensor(seg_column)[seg_of]] + row]
    bad = ((seg_of[1:] == seg_of[:-1]) & (idx[1:] <= idx[:-1])).nonzero()
    if bad.numel():  # as tdgather writes a segment: each frame once, in order
        at = int(bad[0]) + 1
        segment = int(seg_of[at])
        expected = f"strictly increasing indices, each frame once (rows {int(row[at - 1])} and {int(row[at])})"
        raise shards[seg_column[segment]].c.fail(
            f"files{key(filenames[seg_file[segment]])} frame_idx", expected, idx[at - 1 : at + 1].tolist()
        )
    file_of = torch.tensor(seg_file, dtype=torch.int64)[seg_of]
    order = torch.argsort(idx, stable=True)
    order = order[torch.argsort(file_of[order], stable=True)]  # by filename, then frame_idx
    file_of, idx = file_of[order], idx[order]
    twice = ((file_of[1:] == file_of[:-1]) & (idx[1:] == idx[:-1])).nonzero()
    if twice.numel():
        at = int(twice[0])
        raise DatasetError(
            str(dataset.path),
            f"files{key(filenames[int(file_of[at])])} frame_idx",
            f"expected each frame once, got frame {int(idx[at])} twice",
        )
    segment_number = torch.tensor(seg_number, dtype=torch.int32)[seg_of]
    return file_of, segment_number[order], row[order], idx


def collate_frames(items: Sequence[dict[str, Any]] | dict[str, Any]) -> dict[str, Any]:
    """A DataLoader ``collate_fn`` for `FrameDataset` items: a batch's frames as one value, like ``ds[name].frames``.

    torch's default collate and convert walk into a TensorDict as into a dict and fail on one
    frame's (batch size ``[]``); pass this instead, with a ``batch_size`` or ``batch_size=None``.

    Returns:
        Given one item (``batch_size=None``): that item. Given the B items of a batch:
        ``{"filename": [str], "frame_idx": LongTensor[B], "frames": value}``, where ``frames`` holds
        the B frames as `tdgather.Dataset` gives a filename's: a tensor ``[B, ...]``, or a
        TensorDict / tensorclass with batch size ``[B]`` whose fixed leaves are stacked, ragged
        leaves jagged nested tensors ``[B, j, ...]`` and JSON leaves a ``NonTensorStack``. Where
        the frames of a batch differ in layout (filenames saved with other leaves), and for items
        that did not come from `FrameDataset.__getitems__` (which a DataLoader over
        ``ds.per_frame()``, or a ``Subset`` of it, calls), ``frames`` is a list of the B frames.
    """
    if isinstance(items, dict):
        return items
    if isinstance(items, FrameBatch):
        return items.collate()
    return {
        "filename": [x["filename"] for x in items],
        "frame_idx": torch.tensor([x["frame_idx"] for x in items], dtype=torch.int64),
        "frames": [x["frames"] for x in items],
    }


def frame_ranges(frame_idx: Sequence[int] | torch.Tensor) -> str:
    """Sorted frame indexes as runs: ``"0-99, 120-140, 150"``.

    >>> frame_ranges([0, 1, 2, 5, 7, 8])
    '0-2, 5, 7-8'
    """
    values = frame_idx.tolist() if isinstance(frame_idx, torch.Tensor) else list(frame_idx)
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def column_label(path: tuple[str, ...]) -> str:
    """A leaf's column: its keys escaped as in tensor names, joined with ``.``; a plain-tensor frame's is ``frames``.

    So two leaves never share one: ``{"a.b": x}`` is ``a%2Eb``, ``{"a": {"b": y}}`` is ``a.b``.

    >>> column_label(("det", "boxes")), column_label(("a.b",)), column_label(("",)), column_label(())
    ('det.boxes', 'a%2Eb', '%', 'frames')
    """
    return ".".join(map(escape_key, path)) or TENSOR_COLUMN
