"""How gathered frames become shards: which frames a shard holds, and as what tensors.

In a shard, the frames of every filename of one layout ("group" ``g<k>``) are
stored back to back, filenames in sorted order: ``g<k>:frame_idx`` (int64
``[N]``), one tensor per leaf named by its path, ``g<k>.depth``, ``g<k>.det.boxes``
(``[N, ...]``; for a ragged leaf its values, ``[sum N_i, ...]``, with
``g<k>.det.boxes:offsets``, int64 ``[N+1]``: frame ``i``'s rows are
``offsets[i] : offsets[i+1]``), and for JSON leaves their UTF-8 JSON lines (uint8)
with ``:offsets`` (int64 ``[N+1]`` byte offsets); `tdgather.format.names` has the escaping
rule. This is the one module that decides what tensors a shard holds: on the write side, a new
shard layout touches this module and the codec (`tdgather.format.codec`) only.

A write's frames go through here in this order (`tdgather.storage.writer.DatasetWriter.write`):

1. `items_of` makes one `Item` per filename, sorted by name: from ``{filename: Frames}``, or
   from a merge's or `gather`'s groups as views of their columnar buffers (nothing copied per file);
2. the frames already written are left out (`tdgather.storage.ondisk`, through `take`);
3. `fill` splits the items into shards: a new shard where the next item would pass the shard's
   bytes (`frame_bytes`) or the header's limit on its filenames' records;
4. `shard_tensors` lays out one shard: its groups, its tensor entries (as
   `tdgather.format.codec.encode` takes them), and each filename's segment.

The usual write skips the items (`whole_files`): one group of fixed-size tensor leaves whose
every filename is new, one run of frame_idx from one sender (a job of one image per filename, or
of whole videos per rank). Its shards are then `Slice`s, files ``lo:hi`` of the group, cut and
laid out column by column: the same shards, bytes for bytes, without an object per filename.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from operator import attrgetter
from typing import Any, NamedTuple

import torch

from ..core.flatten import flatten
from ..core.frames import Layout
from ..core.ragged import Ragged, joined, offsets_of
from ..format.limits import SHARD_HEADER_MAX, records_bytes, segment_record_bytes
from ..format.names import SHARD_VERSION, group_names
from .catalog import UNKNOWN

__all__ = [
    "Item",
    "Slice",
    "fill",
    "frame_bytes",
    "items_of",
    "record_shard",
    "shard_tensors",
    "shard_totals",
    "take",
    "whole_files",
]


class Item(NamedTuple):
    """One filename's frames in one write: a shard's unit.

    Its frames are rows ``lo:hi`` of a gathered group's buffers (``source``: ``(group, lo, hi)``;
    nothing is sliced per filename until asked), or tensors of its own (``own``: ``(idx, tensors,
    json)``, made by `Item.of`).
    """

    name: str
    layout: Layout
    n: int  # frames
    runs: tuple[int, int] | None  # (lo, hi) when idx is the run lo..hi
    rank: Any  # the sender of every row (int, UNKNOWN if not known), or one per row (int32 tensor)
    source: Any  # (group, lo, hi), or None
    own: Any = None  # (idx, tensors, json) when there is no source

    @classmethod
    def of(cls, name: str, layout: Layout, idx: torch.Tensor, tensors: list, json: list, runs: Any, rank: Any) -> Item:
        """An item of its own tensors: frame_idx ``idx``, a tensor per leaf and a list per JSON leaf."""
        return cls(name, layout, idx.numel(), runs, rank, None, (idx, tensors, json))

    @property
    def idx(self) -> torch.Tensor:
        """Its frame_idx (int64 ``[n]``)."""
        if self.source is None:
            return self.own[0]
        g, lo, hi = self.source
        return g.frame_idx[lo:hi]

    @property
    def tensors(self) -> list:
        """Its leaves' rows, one per tensor leaf (a `Ragged` for a ragged one)."""
        if self.source is None:
            return self.own[1]
        g, lo, hi = self.source
        return [t[lo:hi] for t in g.leaves]

    def leaf(self, j: int) -> Any:
        """Tensor leaf ``j``'s rows alone (`tensors`' ``j``, without slicing the others)."""
        if self.source is None:
            return self.own[1][j]
        g, lo, hi = self.source
        return g.leaves[j][lo:hi]

    @property
    def json(self) -> list[list]:
        """Its JSON leaves' values, one list per leaf."""
        if self.source is None:
            return self.own[2]
        g, lo, hi = self.source
        return [v[lo:hi] for v in g.json]

    @property
    def nbytes(self) -> int:
        """Tensor bytes of its frames: the fixed leaves', and its ragged leaves' values (`frame_bytes`)."""
        if not self.layout.ragged:
            return self.n * self.layout.frame_nbytes
        return frame_bytes(self.layout, self.idx, self.tensors)


def items_of(frames: Any, ranks: Mapping[str, set[int]]) -> list[Item]:
    """One `Item` per filename, sorted by name."""
    groups = getattr(frames, "groups", None)
    if groups is None:
        items = []
        for name in sorted(frames):
            f = frames[name]
            layout, tensors, json_values = flatten(f.frames, f.frame_idx.numel(), f"filename {name!r}")
            items.append(Item.of(name, layout, f.frame_idx, tensors, json_values, None, _one_rank(ranks.get(name))))
        return items
    items = []
    for g in groups:  # rows of the group's buffers: nothing is copied, sliced or rebuilt per file
        runs, senders, layout = _runs_per_file(g), _senders_per_file(g, ranks), g.layout
        items += [
            Item(name, layout, n, run, sender, (g, lo, lo + n))
            for name, lo, n, run, sender in zip(g.files, g.starts, g.counts, runs, senders, strict=True)
        ]
    return sorted(items, key=_name)


_name = attrgetter("name")


def _one_rank(ranks: Any) -> int:
    return next(iter(ranks)) if ranks is not None and len(ranks) == 1 else UNKNOWN


def _runs_per_file(g: Any) -> list[tuple[int, int] | None]:
    """For each file of a group, ``(lo, hi)`` when its frame_idx (sorted, distinct) are the run lo..hi, else None."""
    if not g.frame_idx.numel():
        return [None] * len(g.files)
    lo, hi, one_run = _run_ends(g)
    return [(a, b) if ok else None for a, b, ok in zip(lo.tolist(), hi.tolist(), one_run.tolist(), strict=True)]


def _run_ends(g: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each file's first and last frame_idx, and whether its frames are the run between (a group with frames)."""
    starts, counts = torch.tensor(g.starts, dtype=torch.int64), torch.tensor(g.counts, dtype=torch.int64)
    lo, hi = g.frame_idx[starts], g.frame_idx[starts + counts - 1]
    return lo, hi, (hi - lo + 1 == counts) & (counts > 0)


def _senders_per_file(g: Any, ranks: Mapping[str, set[int]]) -> list[Any]:
    """For each file of a group, the rank that sent all its rows, or (several) each row's, as `Item.rank`.

    The ranks given for a filename come first; else the group's ``rank`` of each row, where it has one.
    """
    bounds = None if ranks else _sender_bounds(g)
    if bounds is None:
        return [_one_rank(ranks.get(name)) for name in g.files]
    low, high = bounds
    return [
        a if a == b else g.rank[s : s + n]
        for a, b, s, n in zip(low.tolist(), high.tolist(), g.starts, g.counts, strict=True)
    ]


def _sender_bounds(g: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each file's lowest and highest sender (from the group's ``rank`` a row); None where rows carry none."""
    rank = getattr(g, "rank", None)
    if rank is None or not rank.numel():
        return None
    file_of = torch.repeat_interleave(torch.arange(len(g.files)), torch.tensor(g.counts, dtype=torch.int64))
    low = torch.full((len(g.files),), 1 << 30, dtype=torch.int32).scatter_reduce(0, file_of, rank, "amin")
    high = torch.full((len(g.files),), -1, dtype=torch.int32).scatter_reduce(0, file_of, rank, "amax")
    return low, high


def take(item: Item, rows: torch.Tensor) -> Item:
    """``item`` with only ``rows`` of its frames."""
    rank = item.rank[rows] if isinstance(item.rank, torch.Tensor) else item.rank
    json_values = [[values[k] for k in rows.tolist()] for values in item.json]
    tensors = [t.index_select(0, rows) for t in item.tensors]
    return Item.of(item.name, item.layout, item.idx[rows], tensors, json_values, None, rank)


def fill(items: list[Item], max_shard_bytes: int) -> list[list[Item]]:
    """``items`` in shards, in order: a new one once the next item would pass ``max_shard_bytes`` or the header's limit.

    A shard's bytes count its tensors and frame indexes; its header holds its filenames' records (many long
    filenames: that limit comes first). A shard holds at least one item.
    """
    names = [item.name for item in items]
    sizes = [item.nbytes + 8 * item.n for item in items]
    return [items[a:b] for a, b in _cuts(names, sizes, max_shard_bytes)]


def _cuts(names: list[str], sizes: list[int], max_shard_bytes: int) -> list[tuple[int, int]]:
    """`fill`'s shards as ``[a, b)`` spans of filenames ``names``, whose frames take ``sizes`` bytes each."""
    if not names:
        return []
    if records_bytes(names) <= SHARD_HEADER_MAX and sum(sizes) <= max_shard_bytes:  # all in one shard
        return [(0, len(names))]
    cuts, size, header = [0], 0, 0
    for k, (name, nbytes) in enumerate(zip(names, sizes, strict=True)):
        record = segment_record_bytes(name)  # many long filenames: the header's limit comes first
        if k > cuts[-1] and (size + nbytes > max_shard_bytes or header + record > SHARD_HEADER_MAX):
            cuts.append(k)
            size = header = 0
        size += nbytes
        header += record
    return list(zip(cuts, [*cuts[1:], len(names)], strict=True))


class Slice(NamedTuple):
    """A shard of whole files, in columns: files ``lo:hi`` of a gathered group (`whole_files`).

    Each file's frame_idx is one run (``runs``, as `Item.runs`) from one sender (``ranks``), and no
    file was written before.
    """

    group: Any
    lo: int
    hi: int
    runs: list[tuple[int, int]]
    ranks: list[int]

    @property
    def names(self) -> list[str]:
        """Its filenames, sorted."""
        return self.group.files[self.lo : self.hi]

    @property
    def rows(self) -> tuple[int, int]:
        """Its rows of the group's buffers, ``[a, b)``."""
        g = self.group
        return g.starts[self.lo], g.starts[self.hi - 1] + g.counts[self.hi - 1]

    @property
    def n(self) -> int:
        """Its frames."""
        a, b = self.rows
        return b - a

    @property
    def nbytes(self) -> int:
        """Its frames' tensor bytes (fixed-size leaves only)."""
        return self.n * self.group.layout.frame_nbytes


def whole_files(frames: Any, ranks: Mapping[str, set[int]], known: Any, max_shard_bytes: int) -> list[Slice] | None:
    """The shards of a write in columns, as `fill` cuts them, or None: not the usual write (then items).

    The usual write: ``frames`` has one group with frames, of fixed-size tensor leaves, every file
    one run of frame_idx from one sender, no ``ranks`` given, and no filename in ``known`` (the
    filenames written before).
    """
    groups = [g for g in getattr(frames, "groups", None) or () if g.files]
    if ranks or len(groups) != 1:
        return None
    g = groups[0]
    if g.layout.ragged or g.layout.nontensor or min(g.counts) < 1 or not known.isdisjoint(g.files):
        return None
    lo, hi, one_run = _run_ends(g)
    bounds = _sender_bounds(g)
    if not bool(one_run.all()) or (bounds is not None and not torch.equal(*bounds)):
        return None
    runs = list(zip(lo.tolist(), hi.tolist(), strict=True))
    senders = [UNKNOWN] * len(g.files) if bounds is None else bounds[0].tolist()
    row = g.layout.frame_nbytes + 8  # a frame's tensor bytes and its frame_idx
    cuts = _cuts(g.files, [row * n for n in g.counts], max_shard_bytes)
    return [Slice(g, a, b, runs[a:b], senders[a:b]) for a, b in cuts]


def shard_tensors(shard: list[Item] | Slice) -> tuple[dict, list, list]:
    """Group a shard's filenames by layout; return group descriptions, tensor entries and each one's segment.

    A segment is ``(group, start, frames)``, in the order of ``shard``.
    """
    if isinstance(shard, Slice):
        return _slice_tensors(shard)
    by_layout: dict[Layout, list[int]] = {}  # each layout's items, by their place in the shard
    layout, places = None, []  # the last item's (the next is usually alike: no hash a filename)
    for k, item in enumerate(shard):
        if item.layout is not layout:
            layout = item.layout
            places = by_layout.setdefault(layout, [])
        places.append(k)
    groups, entries, segments = {}, [], [None] * len(shard)
    for g, (layout, places) in enumerate(by_layout.items()):
        key = f"g{g}"
        names = group_names(key, layout, int(SHARD_VERSION))
        groups[key] = layout.to_json()
        items = [shard[k] for k in places]
        row = 0
        for k, item in zip(places, items, strict=True):
            n = item.n
            segments[k] = (key, row, n)
            row += n
        runs = _runs(items)  # consecutive rows of one gathered group: one piece each, not one a filename
        entries.append((names.frame_idx, torch.int64, (row,), _pieces(items, runs, lambda g: g.frame_idx, None)))
        for j, (name, leaf) in enumerate(zip(names.leaves, layout.leaves, strict=True)):
            if leaf.ragged:
                column = [x.leaf(j) for x in items]  # values, then offsets: frame i is offsets[i] : offsets[i + 1]
                spans = [r.span() for r in joined(column)]
                offsets = offsets_of(torch.cat([n for _, n in spans]))
                values = [v for v, _ in spans]
                entries.append((name, leaf.dtype, (int(offsets[-1]), *leaf.shape), values))
                entries.append((names.offsets(name), torch.int64, (row + 1,), [offsets]))
            else:
                column = _pieces(items, runs, lambda g, j=j: g.leaves[j], j)
                entries.append((name, leaf.dtype, (row, *leaf.shape), column))
        values = [x.json for x in items] if names.json else []  # each item's JSON leaves, sliced once
        for j, name in enumerate(names.json):
            lines = [json.dumps(v, ensure_ascii=False, allow_nan=False).encode() + b"\n" for x in values for v in x[j]]
            offsets = torch.tensor([0, *map(len, lines)], dtype=torch.int64).cumsum(0)
            blob = torch.frombuffer(bytearray(b"".join(lines)), dtype=torch.uint8)
            entries.append((name, torch.uint8, (blob.numel(),), [blob]))
            entries.append((names.offsets(name), torch.int64, (row + 1,), [offsets]))
    return groups, entries, segments


def shard_totals(shard: list[Item] | Slice) -> tuple[list[str], int, int]:
    """A shard's filenames (in order), frames and frame bytes."""
    if isinstance(shard, Slice):
        return shard.names, shard.n, shard.nbytes
    return [item.name for item in shard], sum(item.n for item in shard), sum(item.nbytes for item in shard)


def record_shard(catalog: Any, name: str, shard: list[Item] | Slice, segments: list) -> None:
    """Record shard ``name``'s filenames in ``catalog`` at their ``segments`` (as `shard_tensors` gave them).

    A `Slice`'s (new filenames, one run from one sender each) column by column (`Catalog.extend`).
    """
    if not isinstance(shard, Slice):
        catalog.add_shard(name, shard, segments)
        return
    names = shard.names
    in_group, starts, counts = (list(column) for column in zip(*segments, strict=True))
    layouts, shards = [shard.group.layout] * len(names), [name] * len(names)
    catalog.extend(names, layouts, shards, in_group, starts, counts, shard.runs, shard.ranks)


def _slice_tensors(shard: Slice) -> tuple[dict, list, list]:
    """`shard_tensors` of a `Slice`: one group ``g0``, its rows one piece of each of the group's buffers."""
    g, (a, b) = shard.group, shard.rows
    names = group_names("g0", g.layout, int(SHARD_VERSION))
    starts = [start - a for start in g.starts[shard.lo : shard.hi]]
    segments = list(zip(["g0"] * len(starts), starts, g.counts[shard.lo : shard.hi], strict=True))
    entries = [(names.frame_idx, torch.int64, (b - a,), [g.frame_idx[a:b]])]
    for name, leaf, t in zip(names.leaves, g.layout.leaves, g.leaves, strict=True):
        entries.append((name, leaf.dtype, (b - a, *leaf.shape), [t[a:b]]))
    return {"g0": g.layout.to_json()}, entries, segments


def _runs(items: list[Item]) -> list[tuple[int, int]]:
    """``[a, b)`` spans of ``items`` whose tensors are consecutive rows of one gathered group (`Item.source`).

    An item without a source (frames given per filename, or rows picked out) is a span of its own.
    """
    out: list[tuple[int, int]] = []
    prev = None
    for k, item in enumerate(items):
        src = item.source
        if out and src is not None and prev is not None and src[0] is prev[0] and src[1] == prev[2]:
            out[-1] = (out[-1][0], k + 1)
        else:
            out.append((k, k + 1))
        prev = src
    return out


def _pieces(items: list[Item], runs: list[tuple[int, int]], buffer: Any, j: int | None) -> list:
    """A column's pieces: a run of several items one slice of their group's ``buffer``; else each item's own.

    ``j``: the column is leaf ``j`` (None: frame_idx).
    """
    out = []
    for a, b in runs:
        if b - a > 1:
            g, lo = items[a].source[0], items[a].source[1]
            out.append(buffer(g)[lo : items[b - 1].source[2]])
        else:
            out.append(items[a].idx if j is None else items[a].leaf(j))
    return out


def frame_bytes(layout: Layout, idx: torch.Tensor, tensors: list) -> int:
    """Tensor bytes of one filename's frames: the fixed leaves', and its ragged leaves' values."""
    return idx.numel() * layout.frame_nbytes + sum(t.nbytes for t in tensors if isinstance(t, Ragged))
