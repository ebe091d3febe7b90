"""Stage 4b, merge: parts already in memory into sorted, columnar groups.

Used where payloads are in memory before they are placed: rank dst's own frames, and each
spill of a `tdgather.Collector`. Per layout:

1. plan every row's place from the frame indexes (`tdgather.core.plan.place`, lowest rank first,
   so the first copy of a frame is the lowest rank's);
2. scatter each part's batches into one new buffer per leaf; or, ``by_reference`` (a spill,
   which is written and then dropped) and where rows come in runs of at least `REF_RUN_BYTES`,
   copy nothing: the leaf is `Rows` (a ragged leaf's values too), the parts' own rows in result
   order, which the sink writes with one gathered write per run (`Rows.byte_views`);
3. compare every later copy with the first and resolve it by the `tdgather.core.duplicates` policy
   (kept once and counted by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .duplicates import DuplicateCounts
from .frames import Frames
from .part import Part
from .plan import Group, Mismatches, Placement, keep_first_layouts, place
from .ragged import Ragged
from .scatter import scatter_chunks

__all__ = ["REF_RUN_BYTES", "Merged", "Rows", "as_parts", "cut_groups", "group_bytes", "merge"]

# Rows are written by reference when their runs average at least this: a gathered write of
# ~48 KiB rows is as fast as one of 8 MiB, while small rows are cheaper copied together first.
REF_RUN_BYTES = 16 << 10


class Rows:
    """Rows ``lo .. hi-1`` of one leaf, by reference: row ``k`` is row ``row[k]`` of ``sources[src[k]]``.

    What a merge ``by_reference`` gives in place of a new buffer. Slices stay references;
    `index_select` copies the rows it is asked for; `byte_views` gives the bytes in row order,
    one view per run of consecutive rows of one source.
    """

    def __init__(self, sources: list[torch.Tensor], src: torch.Tensor, row: torch.Tensor, lo: int, hi: int) -> None:
        self.sources, self.src, self.row, self.lo, self.hi = sources, src, row, lo, hi
        first = sources[0]
        self.dtype, self.frame_shape = first.dtype, tuple(first.shape[1:])

    @property
    def shape(self) -> torch.Size:
        """``[rows, *frame shape]``, as a tensor's."""
        return torch.Size((self.hi - self.lo, *self.frame_shape))

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, s: slice) -> Rows:
        lo, hi, step = s.indices(len(self))
        if step != 1:
            raise ValueError("Rows slices take a step of 1")
        return Rows(self.sources, self.src, self.row, self.lo + lo, self.lo + max(lo, hi))

    def follows(self, other: Rows) -> bool:
        """Whether these rows continue ``other`` (the same rows, next in order)."""
        return self.src is other.src and self.sources is other.sources and self.lo == other.hi

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (of this slice), copied into a new tensor."""
        if dim != 0:
            raise ValueError("Rows are selected along dim 0")
        out = torch.empty((index.numel(), *self.frame_shape), dtype=self.dtype)
        src, row = self.src[self.lo + index], self.row[self.lo + index]
        for c in torch.unique(src).tolist():
            at = (src == c).nonzero().flatten()
            out[at] = self.sources[c][row[at]]
        return out

    def byte_views(self) -> list[memoryview]:
        """The rows' bytes in order: one view per run of consecutive rows of one source (none for empty rows)."""
        n = len(self)
        row_bytes = self.dtype.itemsize * torch.Size(self.frame_shape).numel()
        if not n or not row_bytes:  # a leaf of zero bytes a row (``[0, 3]`` a frame) has no bytes to write
            return []
        src, row = self.src[self.lo : self.hi], self.row[self.lo : self.hi]
        head = torch.ones(n, dtype=torch.bool)
        head[1:] = (src[1:] != src[:-1]) | (row[1:] != row[:-1] + 1)
        heads = head.nonzero().flatten()
        lengths = torch.diff(heads, append=torch.tensor([n])).tolist()
        data = [memoryview(s.view(-1).view(torch.uint8).numpy()) if s.numel() else None for s in self.sources]
        return [
            data[c][r * row_bytes : (r + k) * row_bytes]
            for c, r, k in zip(src[heads].tolist(), row[heads].tolist(), lengths, strict=True)
        ]


@dataclass
class Merged:
    """The result of a merge.

    Attributes:
        groups: the frames, one `Group` per layout.
        duplicates: the copies dropped.
        ranks: for each filename, the ranks that sent frames of it (found when asked; each group's
            ``rank`` has the sender of every row).
    """

    groups: list[Group]
    duplicates: DuplicateCounts = field(default_factory=DuplicateCounts)
    parts: list[Part] = field(default_factory=list, repr=False)

    @property
    def ranks(self) -> dict[str, set[int]]:
        """For each filename, the ranks that sent frames of it."""
        return ranks_of(self.parts)

    @property
    def files(self) -> dict[str, Frames]:
        """``{filename: Frames}``, filenames sorted (views of the groups)."""
        out = {name: g.frames(i) for g in self.groups for i, name in enumerate(g.files)}
        return dict(sorted(out.items()))


def merge(
    parts: list[Part],
    duplicates: Any = "keep",
    by_reference: bool = False,
    mismatches: Mismatches | None = None,
    fixed: bool = False,
) -> Merged:
    """Merge parts whose payloads are in memory, in the order given (the first copy of a frame is kept).

    Args:
        parts: the parts, lowest rank first.
        duplicates: the `tdgather.core.duplicates` policy.
        by_reference: where rows come in long runs, leave them where they are (leaves are `Rows`);
            the parts must then stay unchanged while the result is used.
        mismatches: go on past a filename sent with two layouts: keep the frames of the first
            part's layout, and record the filename and its error here (`tdgather.core.plan.place`).
        fixed: frames declared fixed (``ragged=False``): a filename whose first dims differ is a
            mismatch (else those leaves are made ragged, `tdgather.core.promote.unify`).

    Raises:
        ShapeMismatchError: two ranks sent one filename with layouts that do not fit (without ``mismatches``).
        DuplicateFrameError: copies of one ``(filename, frame_idx)`` that the policy refuses.
    """
    groups, found = [], DuplicateCounts()
    for placement, members in place(parts, mismatches, fixed=fixed):
        refs = _references(placement, members) if by_reference else [None] * len(placement.layout.leaves)
        copied = [j for j, r in enumerate(refs) if r is None]
        buffers = refs
        if copied:  # new buffers for the leaves that are copied
            new = placement.allocate(copied)
            for part, dests in zip(members, placement.leaf_dest, strict=True):
                chunks = [[c[j] for j in copied] for c in part.chunks]
                scatter_chunks(new, [dests[j] for j in copied], chunks)
            buffers = list(refs)
            for j, b in zip(copied, new, strict=True):
                buffers[j] = b
        found += placement.check_duplicates(buffers, duplicates)
        groups.append(placement.group(buffers))
    if mismatches:
        groups = keep_first_layouts(groups, mismatches)
    return Merged(groups, found, parts)


def _references(placement: Placement, members: list[Part]) -> list[Any]:
    """Per leaf: `Rows` over the members' batches (a `Ragged` of them when ragged), or None to copy.

    The leaves that are not ragged share their rows' places, so they go by reference together
    when their rows average `REF_RUN_BYTES` a run; each ragged leaf's value rows are judged alone.
    """
    chunks = [c for part in members for c in part.chunks]
    leaves = placement.layout.leaves
    refs: list[Any] = [None] * len(leaves)
    if not chunks:
        return refs
    n = placement.num_frames
    fixed = [j for j, leaf in enumerate(leaves) if not leaf.ragged]
    if fixed:
        rows = _rows_of(placement, chunks, fixed[0], n)
        if rows is not None and n * placement.layout.frame_nbytes >= rows[2] * REF_RUN_BYTES:
            for j in fixed:
                refs[j] = Rows(_sources(chunks, j), rows[0], rows[1], 0, rows[0].numel())
    frame_runs = None
    for j, leaf in enumerate(leaves):
        if leaf.ragged:
            offsets = placement.offsets[j]
            values = int(offsets[n])  # the result's value rows; later copies follow
            if frame_runs is None:
                frame_runs = _frame_runs(placement, members) + len(chunks)
            if values * leaf.row_nbytes < frame_runs * REF_RUN_BYTES:
                continue  # its value rows run no longer than its frames: too short, whatever the chunks
            rows = _rows_of(placement, chunks, j, values)
            if rows is not None and values * leaf.row_nbytes >= rows[2] * REF_RUN_BYTES:
                refs[j] = Ragged(Rows(_sources(chunks, j), rows[0], rows[1], 0, rows[0].numel()), offsets)
    return refs


def _rows_of(placement: Placement, chunks: list, j: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """For leaf ``j``'s buffer rows: the chunk and the row each comes from, and the runs of its first ``n``."""
    rows = torch.tensor([c[j].shape[0] for c in chunks], dtype=torch.int64)
    total = int(rows.sum())
    if not total:
        return None
    starts = torch.cumsum(rows, 0) - rows
    src_of = torch.repeat_interleave(torch.arange(len(chunks)), rows, output_size=total)
    row_of = torch.arange(total) - torch.repeat_interleave(starts, rows, output_size=total)
    dest = torch.cat([d[j][:] for d in placement.leaf_dest])
    src, row = torch.empty_like(src_of), torch.empty_like(row_of)
    src[dest], row[dest] = src_of, row_of
    runs = 1 + int(((src[1:n] != src[: n - 1]) | (row[1:n] != row[: n - 1] + 1)).sum()) if n else 1
    return src, row, runs


def _frame_runs(placement: Placement, members: list[Part]) -> int:
    """Runs of result frames that come from consecutive rows of one part (chunk bounds not counted)."""
    n = placement.num_frames
    part = torch.cat([torch.full_like(d, k) for k, d in enumerate(placement.dest)])
    row = torch.cat([torch.arange(d.numel()) for d in placement.dest])
    dest = torch.cat(placement.dest)
    src, at = torch.empty_like(part), torch.empty_like(row)
    src[dest], at[dest] = part, row
    return 1 + int(((src[1:n] != src[: n - 1]) | (at[1:n] != at[: n - 1] + 1)).sum()) if n else 1


def _sources(chunks: list, j: int) -> list[torch.Tensor]:
    return [c[j] if c[j].is_contiguous() else c[j].contiguous() for c in chunks]


def ranks_of(parts: list[Part]) -> dict[str, set[int]]:
    """For each filename, the ranks whose parts hold frames of it."""
    ranks: dict[str, set[int]] = {}
    for part in parts:
        if part.row_rank is not None:  # rows of several ranks: each (filename, rank) once
            pairs = torch.unique(torch.stack([part.file_ids, part.row_rank.to(torch.int64)]), dim=1)
            for f, r in pairs.t().tolist():
                ranks.setdefault(part.files[f], set()).add(r)
            continue
        for name in part.names:
            ranks.setdefault(name, set()).add(part.rank)
    return ranks


def as_parts(groups: list[Group]) -> list[Part]:
    """Merged groups taken back in as parts, one a group, for a later merge (their rows keep their senders).

    The groups must hold tensors (a merge without ``by_reference``): a part's chunk is each leaf's
    rows (a ragged leaf's value rows, with each frame's count), no copy.
    """
    out = []
    for g in groups:
        counts = torch.tensor(g.counts, dtype=torch.int64)
        file_ids = torch.repeat_interleave(torch.arange(len(g.files)), counts, output_size=g.num_frames)
        chunk, lengths = [], []
        for column in g.leaves:
            if isinstance(column, Ragged):
                values, n = column.span()
                chunk.append(values)
                lengths.append(n)
            else:
                chunk.append(column)
                lengths.append(None)
        if all(n is None for n in lengths):
            lengths = []
        rank = g.rank if g.rank is not None else torch.full((g.num_frames,), -1, dtype=torch.int32)
        first = int(rank[0]) if g.num_frames else -1
        out.append(Part(first, g.layout, g.files, file_ids, g.frame_idx, g.json, [chunk], lengths, rank))
    return out


def group_bytes(g: Group) -> int:
    """Tensor bytes of a group's frames: its fixed leaves' rows and its ragged leaves' values."""
    return sum(column.nbytes for column in g.leaves)


def cut_groups(groups: list[Group], limit: int) -> tuple[list[Group], list[Group]]:
    """``groups`` cut in two at a filename: the first holds at most ``limit`` bytes (at least one filename).

    Bytes as a shard counts them: each frame's tensor bytes and its frame_idx (8). The groups are
    taken in order, and the one that does not fit is cut (views, no copy).
    """
    head: list[Group] = []
    room = limit
    for k, g in enumerate(groups):
        sizes = _file_bytes(g)
        total = int(sizes[-1]) if sizes.numel() else 0
        if total <= room:
            head.append(g)
            room -= total
            continue
        n = int(torch.searchsorted(sizes, room, right=True))  # filenames that fit
        n = max(n, 0 if head else 1)
        if n:
            head.append(g.files_slice(0, n))
        rest = [g.files_slice(n, len(g.files))] if n < len(g.files) else []
        return head, rest + groups[k + 1 :]
    return head, []


def _file_bytes(g: Group) -> torch.Tensor:
    """The running total of each filename's bytes in ``g`` (int64 ``[files]``): tensor bytes and frame_idx."""
    counts = torch.tensor(g.counts, dtype=torch.int64)
    sizes = counts * (g.layout.frame_nbytes + 8)
    ends = torch.cumsum(counts, 0)
    for leaf, column in zip(g.layout.leaves, g.leaves, strict=True):
        if isinstance(column, Ragged):  # its values: each filename's rows
            bound = column.offsets[torch.cat([ends.new_zeros(1), ends])]
            sizes = sizes + bound.diff() * leaf.row_nbytes
    return torch.cumsum(sizes, 0)
