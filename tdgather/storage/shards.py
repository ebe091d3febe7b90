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

__all__ = ["Item", "fill", "frame_bytes", "items_of", "shard_tensors", "take"]


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
    starts, counts = torch.tensor(g.starts, dtype=torch.int64), torch.tensor(g.counts, dtype=torch.int64)
    lo, hi = g.frame_idx[starts], g.frame_idx[starts + counts - 1]
    one_run = (hi - lo + 1 == counts) & (counts > 0)
    return [(a, b) if ok else None for a, b, ok in zip(lo.tolist(), hi.tolist(), one_run.tolist(), strict=True)]


def _senders_per_file(g: Any, ranks: Mapping[str, set[int]]) -> list[Any]:
    """For each file of a group, the rank that sent all its rows, or (several) each row's, as `Item.rank`.

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
    header = records_bytes([item.name for item in items])  # all of them in one shard, when they fit
    if header <= SHARD_HEADER_MAX and sum(item.nbytes + 8 * item.n for item in items) <= max_shard_bytes:
        return [items] if items else []
    shards: list[list[Item]] = [[]]
    size = header = 0
    for item in items:
        nbytes = item.nbytes + 8 * item.n
        record = segment_record_bytes(item.name)  # many long filenames: the header's limit comes first
        if shards[-1] and (size + nbytes > max_shard_bytes or header + record > SHARD_HEADER_MAX):
            shards.append([])
            size = header = 0
        shards[-1].append(item)
        size += nbytes
        header += record
    return [shard for shard in shards if shard]


def shard_tensors(shard: list) -> tuple[dict, list, list]:
    """Group a shard's filenames by layout; return group descriptions, tensor entries and each one's segment.

    A segment is ``(group, start, frames)``, in the order of ``shard``.
    """
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
