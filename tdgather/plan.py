"""Stage 4a, placement: where every row goes, decided from the frame indexes alone.

Rank dst has every sender's filenames and frame indexes before any payload arrives
(`tdgather.protocol`). `place` sorts all of them at once, per layout:

1. rows are ordered by (filename, frame_idx), stably, sources in the order given (callers pass
   them lowest rank first, so the first copy of a frame is the lowest rank's);
2. the first copy of each (filename, frame_idx) gets the next row of the result; every later
   copy (``DistributedSampler`` padding) gets a row past the result's end, kept only until it
   is compared with the first (`Placement.check_duplicates`);
3. so each source row's place is one int64: a payload lands with one scatter, or is received
   straight into place when its rows form one run.

The result of a layout is a `Group`: columnar frames (sorted filenames, counts, frame_idx, one
buffer per leaf). `Frames` are built from a group only when a file is accessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from .duplicates import DuplicateCounts, compare, conflict
from .errors import ShapeMismatchError
from .frames import Frames, Layout, rebuild, run_start, scatter_rows

__all__ = ["Group", "Part", "Placement", "place", "scatter_chunks"]


@dataclass
class Part:
    """One source's frames of one layout, rows in the order they were added or sent.

    Row ``r`` belongs to filename ``files[file_ids[r]]``. ``chunks`` holds the tensor leaves as
    consecutive batches of rows (``chunks[c][j]`` is leaf ``j`` of batch ``c``); it is empty while
    the payload is still on the wire.
    """

    rank: int
    layout: Layout
    files: list[str]
    file_ids: torch.Tensor  # int64 [n]
    frame_idx: torch.Tensor  # int64 [n]
    json: list[list]
    chunks: list[list[torch.Tensor]] = field(default_factory=list)

    @property
    def num_frames(self) -> int:
        """Frames in the part."""
        return self.frame_idx.numel()

    @property
    def nbytes(self) -> int:
        """Tensor bytes of its frames."""
        return self.num_frames * self.layout.frame_nbytes

    @cached_property
    def names(self) -> list[str]:
        """The filenames its rows use (found once: placement and merge both ask)."""
        return [self.files[i] for i in torch.unique(self.file_ids).tolist()]


@dataclass
class Group:
    """Frames of one layout, columnar: filenames sorted, each one's rows sorted by ``frame_idx``.

    Filename ``files[i]`` holds rows ``starts[i] : starts[i] + counts[i]`` of ``frame_idx``, of
    every tensor in ``leaves`` (``[N, *leaf.shape]``) and of every list in ``json``.
    """

    layout: Layout
    files: list[str]
    counts: list[int]
    frame_idx: torch.Tensor
    leaves: list[torch.Tensor]
    json: list[list]
    starts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.starts = torch.tensor([0, *self.counts], dtype=torch.int64).cumsum(0)[:-1].tolist()

    @property
    def num_frames(self) -> int:
        """Frames in the group."""
        return self.frame_idx.numel()

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

    @property
    def num_frames(self) -> int:
        """Frames in the result."""
        return self.frame_idx.numel()

    def allocate(self) -> list[torch.Tensor]:
        """One buffer per leaf, ``[N + D, *leaf.shape]``: the result, then the later copies."""
        rows = self.num_frames + self.kept.numel()
        return [torch.empty((rows, *leaf.shape), dtype=leaf.dtype) for leaf in self.layout.leaves]

    def group(self, buffers: list[torch.Tensor]) -> Group:
        """The result: views of the first N rows."""
        n = self.num_frames
        return Group(self.layout, self.files, self.counts, self.frame_idx, [b[:n] for b in buffers], self.json)

    def salvage(self, buffers: list[torch.Tensor], landed: torch.Tensor) -> Group:
        """The result from the rows that landed (a sender failed part-way), one copy per frame.

        A frame whose first copy never came takes a later copy that did.
        """
        n = self.num_frames
        have = landed[:n].clone()
        if self.kept.numel():
            stand_in = (landed[n:] & ~have[self.kept]).nonzero().flatten()
            for b in buffers:
                b[self.kept[stand_in]] = b[n + stand_in]
            have[self.kept[stand_in]] = True
        keep = have.nonzero().flatten()
        file_of = torch.repeat_interleave(torch.arange(len(self.files)), torch.tensor(self.counts, dtype=torch.int64))
        counts = torch.bincount(file_of[keep], minlength=len(self.files)).tolist()
        return Group(
            self.layout,
            [f for f, c in zip(self.files, counts, strict=True) if c],
            [c for c in counts if c],
            self.frame_idx[keep],
            [b.index_select(0, keep) for b in buffers],
            [[values[k] for k in keep.tolist()] for values in self.json],
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
            who = f"ranks {int(self.kept_rank[k])} and {int(self.later_rank[k])}"
            raise conflict(name, int(self.frame_idx[row]), verdict.describe(k), policy, who)
        return verdict.counts


def place(parts: list[Part]) -> list[tuple[Placement, list[Part]]]:
    """Plan every layout of ``parts`` (lowest rank first); return each placement with its parts.

    Raises:
        ShapeMismatchError: a filename comes with two layouts (from one rank or two).
    """
    by_layout: dict[Layout, list[Part]] = {}
    owner: dict[str, tuple[Layout, int]] = {}
    for part in parts:
        if not part.num_frames:
            continue
        for name in part.names:
            layout, rank = owner.setdefault(name, (part.layout, part.rank))
            if layout != part.layout:
                raise ShapeMismatchError(
                    f"filename {name!r}: rank {rank} sent {layout.describe()} but rank {part.rank} sent "
                    f"{part.layout.describe()} (ranks {sorted({rank, part.rank})}); every frame of a filename "
                    "must have the same structure, shape and dtype"
                )
        by_layout.setdefault(part.layout, []).append(part)
    return [(_place_layout(layout, group), group) for layout, group in by_layout.items()]


def _place_layout(layout: Layout, parts: list[Part]) -> Placement:
    names = sorted({n for p in parts for n in p.names})
    fid = {n: i for i, n in enumerate(names)}
    fids = torch.cat([torch.tensor([fid.get(n, -1) for n in p.files], dtype=torch.int64)[p.file_ids] for p in parts])
    idx = torch.cat([p.frame_idx for p in parts])
    sizes = [p.num_frames for p in parts]
    total = idx.numel()
    # 1. sort by (file, frame_idx), stably: one sort of a joint key where it fits in int64
    low = int(idx.min()) if total else 0
    span = int(idx.max()) - low + 1 if total else 1
    if len(names) * span < 1 << 62:
        key, order = torch.sort(fids * span + (idx - low), stable=True)
        sf, si = None, None
    else:
        order = torch.argsort(idx, stable=True)
        order = order[torch.argsort(fids[order], stable=True)]
        sf, si = fids[order], idx[order]
        key = None
    # 2. the first copy of each frame takes the next result row; later copies go past the end
    first = torch.ones(total, dtype=torch.bool)
    if key is not None:
        torch.ne(key[1:], key[:-1], out=first[1:])
        first_key = key[first]
        first_file, first_idx = first_key // span, first_key % span + low
    else:
        first[1:] = (sf[1:] != sf[:-1]) | (si[1:] != si[:-1])
        first_file, first_idx = sf[first], si[first]
    n = first_file.numel()
    dest_all = torch.empty_like(order)
    if n == total:  # no copies: sorted row k is result row k
        dest_all[order] = torch.arange(total)
        kept = later_pos = torch.empty(0, dtype=torch.int64)
    else:
        firsts = first.cumsum(0)
        later = ~first
        # sorted row k is the (k - firsts[k])-th later copy when it is not a first
        pos = torch.where(first, firsts - 1, n + torch.arange(total) - firsts)
        dest_all[order] = pos
        later_pos, kept = order[later], firsts[later] - 1
    bounds = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    ranks = torch.tensor([p.rank for p in parts], dtype=torch.int64)
    later_rank = ranks[torch.searchsorted(bounds, later_pos, right=True)]
    kept_rank = ranks[torch.searchsorted(bounds, order[first][kept], right=True)] if kept.numel() else kept
    json_all = [[v for p in parts for v in p.json[j]] for j in range(len(layout.nontensor))]
    json, later_json = [], []
    if json_all:
        keep_pos, later_list = order[first].tolist(), later_pos.tolist()
        json = [[values[k] for k in keep_pos] for values in json_all]
        later_json = [[values[k] for k in later_list] for values in json_all]
    return Placement(
        layout,
        names,
        torch.bincount(first_file, minlength=len(names)).tolist(),
        first_idx,
        list(torch.split(dest_all, sizes)),
        kept,
        kept_rank,
        later_rank,
        json,
        later_json,
    )


_SMALL_CHUNK = 1 << 20  # below this average batch size, chunks are joined and scattered in one kernel


def scatter_chunks(buffers: list[torch.Tensor], dest: torch.Tensor, chunks: list[list[torch.Tensor]]) -> None:
    """Copy a part's chunks (consecutive batches of rows) to rows ``dest`` of ``buffers``."""
    if not chunks or not dest.numel() or not buffers:
        return
    nbytes = sum(t.numel() * t.element_size() for c in chunks for t in c)
    if len(chunks) > 8 and nbytes < len(chunks) * _SMALL_CHUNK:  # many small batches: one scatter per leaf
        chunks = [[torch.cat([c[j] for c in chunks]) for j in range(len(buffers))]]
    start = 0
    for chunk in chunks:
        rows = chunk[0].shape[0] if chunk else 0
        d = dest[start : start + rows]
        start += rows
        first = run_start(d)
        for buf, t in zip(buffers, chunk, strict=True):
            scatter_rows(buf, d if first is None else first, t)
