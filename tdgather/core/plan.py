"""Stage 4a, placement: where every row goes, decided from the frame indexes alone.

Rank dst has every sender's filenames and frame indexes before any payload arrives
(`tdgather.comm.protocol`). `place` sorts all of them at once, per layout:

1. rows are ordered by (filename, frame_idx), stably, sources in the order given (callers pass
   them lowest rank first, so the first copy of a frame is the lowest rank's);
2. the first copy of each (filename, frame_idx) gets the next row of the result; every later
   copy (``DistributedSampler`` padding) gets a row past the result's end, kept only until it
   is compared with the first (`Placement.check_duplicates`);
3. so each source row's place is one int64: a payload lands with one scatter, or is received
   straight into place when its rows form one run;
4. a ragged leaf's buffer is its values, frames back to back in buffer-row order: from every
   row's length its offsets follow, and from those each source value row's place
   (`Placement.leaf_dest`, as `tdgather.core.scatter.ValuePlaces`), so ragged values land the same way.

The result of a layout is a `Group`: columnar frames (sorted filenames, counts, frame_idx, one
buffer per leaf). `Frames` are built from a group only when a file is accessed. Rows are copied
into their places by `tdgather.core.scatter`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from ..errors import ShapeMismatchError
from .duplicates import DuplicateCounts, compare, conflict
from .frames import Frames, Layout
from .part import Part
from .promote import SAME_LAYOUT, ragged_hint, unify
from .ragged import Ragged, offsets_of
from .rebuild import rebuild
from .scatter import ValuePlaces

__all__ = [
    "Group",
    "Mismatches",
    "Placement",
    "keep_first_layouts",
    "place",
]

_NO_ROWS = torch.empty(0, dtype=torch.int64)


@dataclass
class Group:
    """Frames of one layout, columnar: filenames sorted, each one's rows sorted by ``frame_idx``.

    Filename ``files[i]`` holds rows ``starts[i] : starts[i] + counts[i]`` of ``frame_idx``, of
    every tensor in ``leaves`` (``[N, *leaf.shape]``; a `Ragged` of N frames for a ragged leaf)
    and of every list in ``json``. ``rank`` (int32 ``[N]``), where known, is the rank that sent each row.
    """

    layout: Layout
    files: list[str]
    counts: list[int]
    frame_idx: torch.Tensor
    leaves: list[torch.Tensor]
    json: list[list]
    rank: torch.Tensor | None = None
    starts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.starts = torch.tensor([0, *self.counts], dtype=torch.int64).cumsum(0)[:-1].tolist()

    @property
    def num_frames(self) -> int:
        """Frames in the group."""
        return self.frame_idx.numel()

    def without(self, names: list[str]) -> Group:
        """A copy of the group without the frames of ``names``."""
        gone = set(names)
        keep = [i for i, name in enumerate(self.files) if name not in gone]
        rows = torch.cat([torch.arange(self.starts[i], self.starts[i] + self.counts[i]) for i in keep] or [_NO_ROWS])
        return Group(
            self.layout,
            [self.files[i] for i in keep],
            [self.counts[i] for i in keep],
            self.frame_idx[rows],
            [t.index_select(0, rows) for t in self.leaves],
            [[values[k] for k in rows.tolist()] for values in self.json],
            None if self.rank is None else self.rank[rows],
        )

    def files_slice(self, lo: int, hi: int) -> Group:
        """The frames of ``files[lo:hi]``, as a group: views of this one's buffers."""
        a = self.starts[lo] if lo < len(self.files) else self.num_frames
        b = self.starts[hi] if hi < len(self.files) else self.num_frames
        return Group(
            self.layout,
            self.files[lo:hi],
            self.counts[lo:hi],
            self.frame_idx[a:b],
            [t[a:b] for t in self.leaves],
            [values[a:b] for values in self.json],
            None if self.rank is None else self.rank[a:b],
        )

    def frames(self, i: int) -> Frames:
        """The `Frames` of ``files[i]``: views of the group's buffers."""
        lo, n = self.starts[i], self.counts[i]
        tensors = [t[lo : lo + n] for t in self.leaves]
        json = [values[lo : lo + n] for values in self.json]
        return Frames(
            frame_idx=self.frame_idx[lo : lo + n], frames=rebuild(self.layout, n, tensors, json), batch_size=[n]
        )


@dataclass
class Placement:
    """Where every row of one layout goes, over all its sources.

    Buffer rows ``0 .. N-1`` are the result; row ``N + d`` holds later copy ``d``, which repeats
    result row ``kept[d]``.
    """

    layout: Layout
    files: list[str]
    counts: list[int]
    frame_idx: torch.Tensor  # int64 [N]
    dest: list[torch.Tensor]  # per source, in the order given: each row's buffer row
    kept: torch.Tensor  # int64 [D]
    kept_rank: torch.Tensor  # int64 [D]: the rank of the kept copy
    later_rank: torch.Tensor  # int64 [D]: the rank of the later copy
    json: list[list]  # N values per JSON leaf
    later_json: list[list]  # D values per JSON leaf
    offsets: list[torch.Tensor | None] = field(default_factory=list)  # per ragged leaf: [N + D + 1]
    # per source, per leaf: the buffer rows its rows go to (a ragged leaf's: `ValuePlaces`, sliced as needed)
    leaf_dest: list[list[Any]] = field(default_factory=list)
    rank: torch.Tensor | None = None  # int32 [N]: the rank of each result row's (kept) copy

    @property
    def num_frames(self) -> int:
        """Frames in the result."""
        return self.frame_idx.numel()

    def shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Each leaf's buffer as `allocate` makes it (a ragged leaf's: its values): shape and dtype."""
        rows = self.num_frames + self.kept.numel()
        offsets = self.offsets or [None] * len(self.layout.leaves)
        return [
            ((rows if off is None else int(off[-1]), *leaf.shape), leaf.dtype)
            for leaf, off in zip(self.layout.leaves, offsets, strict=True)
        ]

    def allocate(self, leaves: list[int] | None = None, empty: Any = None) -> list[Any]:
        """One buffer per leaf (or per leaf of ``leaves``), ``[N + D, *leaf.shape]``.

        Rows ``0 .. N-1`` are the result, then the later copies. A ragged leaf's buffer is a
        `Ragged` of N + D frames over new values. ``empty(shape, dtype)`` makes each (default
        ``torch.empty``; rank dst's shared result memory: `tdgather.comm.direct`).
        """
        empty = empty or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        offsets = self.offsets or [None] * len(self.layout.leaves)
        shapes = self.shapes()
        out = []
        for j in range(len(self.layout.leaves)) if leaves is None else leaves:
            values = empty(*shapes[j])
            out.append(values if offsets[j] is None else Ragged(values, offsets[j]))
        return out

    def group(self, buffers: list[torch.Tensor]) -> Group:
        """The result: views of the first N rows."""
        n = self.num_frames
        leaves = [b[:n] for b in buffers]
        return Group(self.layout, self.files, self.counts, self.frame_idx, leaves, self.json, self.rank)

    def salvage(self, buffers: list[torch.Tensor], landed: torch.Tensor) -> Group:
        """The result from the rows that landed (a sender failed part-way), one copy per frame.

        A frame whose first copy never came takes a later copy that did.
        """
        n = self.num_frames
        have = landed[:n].clone()
        take = torch.arange(n)  # the buffer row each result row is taken from
        rank = None if self.rank is None else self.rank.clone()
        if self.kept.numel():
            stand_in = (landed[n:] & ~have[self.kept]).nonzero().flatten()
            take[self.kept[stand_in]] = n + stand_in
            have[self.kept[stand_in]] = True
            if rank is not None:
                rank[self.kept[stand_in]] = self.later_rank[stand_in].to(torch.int32)
        keep = have.nonzero().flatten()
        file_of = torch.repeat_interleave(torch.arange(len(self.files)), torch.tensor(self.counts, dtype=torch.int64))
        counts = torch.bincount(file_of[keep], minlength=len(self.files)).tolist()
        return Group(
            self.layout,
            [f for f, c in zip(self.files, counts, strict=True) if c],
            [c for c in counts if c],
            self.frame_idx[keep],
            [b.index_select(0, take[keep]) for b in buffers],
            [[values[k] for k in keep.tolist()] for values in self.json],
            None if rank is None else rank[keep],
        )

    def check_duplicates(self, buffers: list[torch.Tensor], policy: Any) -> DuplicateCounts:
        """Compare every later copy with the row it repeats; raise when the policy refuses one."""
        d = self.kept.numel()
        if not d:
            return DuplicateCounts()
        later = torch.arange(self.num_frames, self.num_frames + d)
        verdict = compare(
            self.layout,
            [b.index_select(0, later) for b in buffers],
            [b.index_select(0, self.kept) for b in buffers],
            self.later_json,
            [[values[k] for k in self.kept.tolist()] for values in self.json],
            policy,
        )
        if bool(verdict.refused.any()):
            k = int(verdict.refused.nonzero()[0])
            row = int(self.kept[k])
            name = self.files[int(torch.searchsorted(torch.tensor(self.counts).cumsum(0), row, right=True))]
            a, b = int(self.kept_rank[k]), int(self.later_rank[k])
            who = f"ranks {a} and {b}" if a != b else f"rank {a}, in two copies,"
            raise conflict(name, int(self.frame_idx[row]), verdict.describe(k), policy, who)
        return verdict.counts


# filename -> (the layout kept, the error that names the other): what `place` and
# `tdgather.storage.writer.DatasetWriter.write` report instead of raising, when asked to go on
Mismatches = dict[str, tuple[Layout, ShapeMismatchError]]


def place(
    parts: list[Part], mismatches: Mismatches | None = None, fixed: bool = False
) -> list[tuple[Placement, list[Part]]]:
    """Plan every layout of ``parts`` (lowest rank first); return each placement with its parts.

    First, leaves whose first dim varies within a filename (across its parts) are made ragged in
    every part, and so are leaves ragged in any part (`tdgather.core.promote.unify`); the members
    returned are those promoted parts. Not with ``fixed`` (frames declared fixed, ``ragged=False``).

    A filename that comes with two layouts that do not fit (from one rank or two) raises
    `ShapeMismatchError`; given ``mismatches``, it is recorded there instead, with the layout of the
    first part that has it, and placed in both: `keep_first_layouts` then drops the frames of the other.
    """
    if not fixed:
        parts = unify(parts)
    by_layout: dict[Layout, list[Part]] = {}
    owner: dict[str, tuple[Layout, int]] = {}
    one_layout = len({p.layout for p in parts if p.num_frames}) == 1  # no filename can have two
    for part in parts:
        if not part.num_frames:
            continue
        for name in () if one_layout else part.names:
            layout, rank = owner.setdefault(name, (part.layout, part.rank_of(name)))
            if layout != part.layout and name not in (mismatches or ()):
                other = part.rank_of(name)
                sent = (
                    f"frames on rank {rank} have {layout.describe()} and {part.layout.describe()}"
                    if rank == other
                    else f"rank {rank} sent {layout.describe()} but rank {other} sent {part.layout.describe()}"
                )
                error = ShapeMismatchError(
                    f"filename {name!r}: {sent} (ranks {sorted({rank, other})}); {SAME_LAYOUT}"
                    f"{ragged_hint(layout, part.layout)}"
                )
                if mismatches is None:
                    raise error
                mismatches[name] = (layout, error)
        by_layout.setdefault(part.layout, []).append(part)
    return [(_place_layout(layout, group), group) for layout, group in by_layout.items()]


def keep_first_layouts(groups: list[Group], mismatches: Mismatches) -> list[Group]:
    """``groups`` without the frames of a mismatched filename in any layout but the one kept."""
    out = []
    for g in groups:
        drop = [name for name in g.files if name in mismatches and mismatches[name][0] != g.layout]
        out.append(g.without(drop) if drop else g)
    return out


def _place_layout(layout: Layout, parts: list[Part]) -> Placement:
    # filenames in order of the parts (each usually sorted already: a sort then only merges the runs)
    names = sorted(dict.fromkeys(chain.from_iterable(p.names for p in parts)))
    fid = dict(zip(names, range(len(names)), strict=True))
    fids = torch.cat([torch.tensor(_ids(fid, p), dtype=torch.int64).index_select(0, p.file_ids) for p in parts])
    idx = torch.cat([p.frame_idx for p in parts])
    sizes = [p.num_frames for p in parts]
    total = idx.numel()
    if any(p.row_rank is not None for p in parts):  # a merge's result among them: rows of several ranks
        row_rank = torch.cat([p.ranks() for p in parts])
    else:
        row_rank = torch.repeat_interleave(
            torch.tensor([p.rank for p in parts], dtype=torch.int32), torch.tensor(sizes, dtype=torch.int64)
        )
    none = torch.empty(0, dtype=torch.int64)
    # 1. sort by (file, frame_idx), stably: one sort of a joint key where it fits in int64; where
    # the keys are dense and distinct (no copies), their ranks are counted instead (no sort)
    low = int(idx.min()) if total else 0
    span = int(idx.max()) - low + 1 if total else 1
    joint = fids * span + (idx - low) if len(names) * span < 1 << 62 else None
    counted = _counted_places(joint, len(names) * span) if joint is not None else None
    if counted is not None:  # 2. no copies: sorted row k is result row k
        order, dest_all = counted
        first_file, first_idx, first_rank = (t.index_select(0, order) for t in (fids, idx, row_rank))
        kept = later_pos = later_rank = kept_rank = none
        keep_pos = order
    else:
        order, first = _sorted_rows(fids, idx, joint)
        first_file, first_idx = fids[order][first], idx[order][first]
        # 2. the first copy of each frame takes the next result row; later copies go past the end
        n, dest_all = first_file.numel(), torch.empty_like(order)
        firsts = first.cumsum(0)
        later = ~first
        # sorted row k is the (k - firsts[k])-th later copy when it is not a first
        dest_all[order] = torch.where(first, firsts - 1, n + torch.arange(total) - firsts)
        later_pos, kept, keep_pos = order[later], firsts[later] - 1, order[first]
        first_rank = row_rank[keep_pos]
        later_rank = row_rank[later_pos].to(torch.int64)
        kept_rank = row_rank[keep_pos[kept]].to(torch.int64)
    json_all = [[v for p in parts for v in p.json[j]] for j in range(len(layout.nontensor))]
    json, later_json = [], []
    if json_all:
        keep_list, later_list = keep_pos.tolist(), later_pos.tolist()
        json = [[values[k] for k in keep_list] for values in json_all]
        later_json = [[values[k] for k in later_list] for values in json_all]
    dest = list(torch.split(dest_all, sizes))
    offsets, leaf_dest = _ragged_places(layout, parts, dest, dest_all, first_idx.numel() + kept.numel())
    return Placement(
        layout,
        names,
        torch.bincount(first_file, minlength=len(names)).tolist(),
        first_idx,
        dest,
        kept,
        kept_rank,
        later_rank,
        json,
        later_json,
        offsets,
        leaf_dest,
        first_rank,
    )


def _ids(fid: dict[str, int], part: Part) -> list[int]:
    """Each of the part's files' number in ``fid``; -1 for a file no row uses (not there)."""
    if len(part.names) == len(part.files):  # every file used: each one is there
        return list(map(fid.__getitem__, part.files))
    return [fid.get(n, -1) for n in part.files]


def _sorted_rows(
    fids: torch.Tensor, idx: torch.Tensor, joint: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stable order of rows by (file id, frame_idx), and which sorted rows are a frame's first copy.

    ``joint``: the two as one int64 key, where that fits (one sort instead of two).
    """
    if joint is not None:
        key, order = torch.sort(joint, stable=True)
    else:
        order = torch.argsort(idx, stable=True)
        order = order[torch.argsort(fids[order], stable=True)]
        key = None
    first = torch.ones(order.numel(), dtype=torch.bool)
    if key is not None:
        torch.ne(key[1:], key[:-1], out=first[1:])
    else:
        sf, si = fids[order], idx[order]
        first[1:] = (sf[1:] != sf[:-1]) | (si[1:] != si[:-1])
    return order, first


def _counted_places(key: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The order that sorts ``key`` (values in ``[0, span)``) and each key's place in it, by counting.

    None unless the keys are dense (a count per value is cheaper than a sort) and distinct.

    >>> [t.tolist() for t in _counted_places(torch.tensor([3, 0, 2]), 4)]
    [[1, 2, 0], [2, 0, 1]]
    """
    if not key.numel() or span > 4 * key.numel() + 1024:
        return None
    counts = torch.bincount(key, minlength=span)
    if int(counts.max()) > 1:  # copies of a frame: the stable sort keeps them in rank order
        return None
    places = key if key.numel() == span else counts.cumsum(0).index_select(0, key) - 1  # no gaps: the key
    return torch.empty_like(key).index_copy_(0, places, torch.arange(key.numel())), places


def _ragged_places(
    layout: Layout, parts: list[Part], dest: list[torch.Tensor], dest_all: torch.Tensor, rows: int
) -> tuple[list, list[list[Any]]]:
    """Per ragged leaf, the buffer's offsets; per source and leaf, where its value rows go.

    Buffer row ``dest[r]`` holds source row ``r``, so it has that row's length; a source's value
    rows of frame ``r`` go to ``offsets[dest[r]]`` on.
    """
    if not layout.ragged:
        return [], [[d] * len(layout.leaves) for d in dest]
    offsets: list[torch.Tensor | None] = []
    leaf_dest: list[list[Any]] = [[] for _ in parts]
    for j, leaf in enumerate(layout.leaves):
        if not leaf.ragged:
            offsets.append(None)
            for k, d in enumerate(dest):
                leaf_dest[k].append(d)
            continue
        lengths = torch.empty(rows, dtype=torch.int64)
        lengths[dest_all] = torch.cat([p.lengths[j] for p in parts])
        off = offsets_of(lengths)
        offsets.append(off)
        for k, (p, d) in enumerate(zip(parts, dest, strict=True)):
            leaf_dest[k].append(ValuePlaces(d, p.lengths[j], off))
    return offsets, leaf_dest
