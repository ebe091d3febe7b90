"""Stage 4, merge: one `Frames` per filename, ordered by ``frame_idx``.

Parts of one layout are merged together, vectorised:

1. sort every row by (filename, frame_idx), stably, parts in the order given (callers pass
   them by rank, so the first copy of a frame is the lowest rank's);
2. find duplicates (``DistributedSampler`` padding): every later copy is compared with the
   first and resolved by the `tdgather.duplicates` policy (kept once and counted by default);
3. a filename whose rows all came from one part, already in order, is returned
   as views of the received buffer (no copy);
4. the rows of every other filename are scattered once into one new buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .duplicates import DuplicateCounts, compare, conflict
from .errors import ShapeMismatchError
from .frames import Frames, Layout, Part, rebuild, row_view, run_start, scatter_rows

__all__ = ["Merged", "merge"]


@dataclass
class Merged:
    """The result of a merge.

    Attributes:
        files: ``{filename: Frames}``, filenames sorted.
        duplicates: the copies dropped.
        ranks: for each filename, the ranks that sent frames of it.
    """

    files: dict[str, Frames]
    duplicates: DuplicateCounts = field(default_factory=DuplicateCounts)
    ranks: dict[str, set[int]] = field(default_factory=dict)


def merge(parts: list[Part], duplicates: Any = "keep") -> Merged:
    """Merge the parts of every rank, in the order given (the first copy of a frame is kept).

    Args:
        parts: the parts, lowest rank first for a deterministic choice among copies.
        duplicates: the `tdgather.duplicates.DuplicatePolicy` (or its mode name).

    Raises:
        ShapeMismatchError: two ranks sent one filename with different layouts.
        DuplicateFrameError: copies of one ``(filename, frame_idx)`` that the policy refuses.
    """
    by_layout: dict[Layout, list[Part]] = {}
    owner: dict[str, Part] = {}
    ranks: dict[str, set[int]] = {}
    for part in parts:
        for name in part.files:
            ranks.setdefault(name, set()).add(part.rank)
            first = owner.setdefault(name, part)
            if first.layout != part.layout:
                raise ShapeMismatchError(
                    f"filename {name!r}: rank {first.rank} sent {first.layout.describe()} but rank {part.rank} "
                    f"sent {part.layout.describe()} (ranks {sorted({first.rank, part.rank})}); every frame "
                    "of a filename must have the same structure, shape and dtype"
                )
        by_layout.setdefault(part.layout, []).append(part)
    out: dict[str, Frames] = {}
    found = DuplicateCounts()
    for layout, group in by_layout.items():
        found += _merge_layout(layout, group, out, duplicates)
    return Merged(dict(sorted(out.items())), found, ranks)


def _merge_layout(layout: Layout, group: list[Part], out: dict[str, Frames], policy: Any) -> DuplicateCounts:
    names = sorted({n for p in group for n in p.files})
    fid = {n: i for i, n in enumerate(names)}
    sizes = [p.num_frames for p in group]
    bases = torch.tensor([0, *sizes]).cumsum(0)
    fids = torch.cat([torch.tensor([fid[n] for n in p.files], dtype=torch.int64)[p.rows] for p in group])
    idx = torch.cat([p.frame_idx for p in group])
    # 1. sort by (file, frame_idx)
    order = torch.argsort(idx, stable=True)
    order = order[torch.argsort(fids[order], stable=True)]
    sf, si = fids[order], idx[order]
    same_file = sf[1:] == sf[:-1]
    # 2. duplicates: each later copy against the first of its run
    dup = same_file & (si[1:] == si[:-1])
    found = DuplicateCounts()
    if bool(dup.any()):
        rows = torch.arange(si.numel())
        first_of_run = torch.cummax(torch.where(torch.cat([torch.tensor([True]), ~dup]), rows, 0), 0).values
        later = rows[1:][dup]
        found = _check_duplicates(
            names, layout, group, bases, order[first_of_run[later]], order[later], sf[later], si[later], policy
        )
    keep = torch.ones_like(si, dtype=torch.bool)
    keep[1:] = ~dup
    # 3. files sent whole, in order, by one part: consecutive source rows and no duplicates
    part_start = torch.zeros_like(si, dtype=torch.bool)
    part_start[bases[1:-1]] = True  # a step onto another part's first row is not "in order"
    broken = same_file & (((order[1:] - order[:-1]) != 1) | dup | part_start[order[1:]])
    copied = torch.zeros(len(names), dtype=torch.bool)
    copied[sf[1:][broken]] = True
    counts = torch.bincount(sf[keep], minlength=len(names))
    per_file = torch.bincount(sf, minlength=len(names))  # rows per file, duplicates included
    starts = per_file.cumsum(0) - per_file
    # 4. one scatter of the other files' rows into a compact buffer
    moved = keep & copied[sf]
    select = order[moved]
    buffers = _scatter(layout, group, bases, select)
    sorted_idx = si[moved]
    json_all = [[v for p in group for v in p.json[j]] for j in range(len(layout.nontensor))]
    offset = 0
    for f, name in enumerate(names):
        n = int(counts[f])
        if bool(copied[f]):
            lo, hi = offset, offset + n
            offset = hi
            frame_idx = sorted_idx[lo:hi]
            tensors = [b[lo:hi] for b in buffers]
            rows = select[lo:hi].tolist() if json_all else []
        else:
            src = int(order[starts[f]])
            k = int(torch.searchsorted(bases, src, right=True)) - 1
            lo, hi = src - int(bases[k]), src - int(bases[k]) + n
            frame_idx = group[k].frame_idx[lo:hi]
            tensors = [t[lo:hi] for t in group[k].leaves]
            rows = range(src, src + n)
        json = [[values[r] for r in rows] for values in json_all]
        out[name] = Frames(frame_idx=frame_idx, frames=rebuild(layout, n, tensors, json), batch_size=[n])
    return found


def _scatter(layout: Layout, group: list[Part], bases: torch.Tensor, select: torch.Tensor) -> list[torch.Tensor]:
    """Gather rows ``select`` (positions in the parts' concatenation) into new buffers, in that order."""
    buffers = [torch.empty((select.numel(), *leaf.shape), dtype=leaf.dtype) for leaf in layout.leaves]
    if not select.numel():
        return buffers
    dest = torch.full((int(bases[-1]),), -1, dtype=torch.int64)
    dest[select] = torch.arange(select.numel())
    for k, part in enumerate(group):
        d = dest[int(bases[k]) : int(bases[k + 1])]
        local = (d >= 0).nonzero().flatten()
        if not local.numel():
            continue
        whole = local.numel() == d.numel()
        d = d if whole else d[local]
        first = run_start(d)
        for buf, t in zip(buffers, part.leaves, strict=True):
            scatter_rows(buf, d if first is None else first, t if whole else t.index_select(0, local))
    return buffers


def _check_duplicates(names, layout, group, bases, first, later, files, frames, policy) -> DuplicateCounts:
    """Compare each later copy (positions in the parts' concatenation) with the first; raise on a refusal."""
    json_all = [[v for p in group for v in p.json[j]] for j in range(len(layout.nontensor))]
    verdict = compare(
        layout,
        [_rows_at(group, bases, j, later) for j in range(len(layout.leaves))],
        [_rows_at(group, bases, j, first) for j in range(len(layout.leaves))],
        [[values[i] for i in later.tolist()] for values in json_all],
        [[values[i] for i in first.tolist()] for values in json_all],
        policy,
    )
    if bool(verdict.refused.any()):
        k = int(verdict.refused.nonzero()[0])
        ra, rb = (group[int(torch.searchsorted(bases, x, right=True)) - 1].rank for x in (first[k], later[k]))
        raise conflict(names[int(files[k])], int(frames[k]), verdict.describe(k), policy, f"ranks {ra} and {rb}")
    return verdict.counts


def _rows_at(group: list[Part], bases: torch.Tensor, leaf: int, positions: torch.Tensor) -> torch.Tensor:
    """Rows at ``positions`` of the parts' concatenation (leaf ``[K, ...]``, its own dtype)."""
    part_of = torch.searchsorted(bases, positions, right=True) - 1
    sample = group[0].leaves[leaf]
    rows = torch.empty((positions.numel(), *sample.shape[1:]), dtype=sample.dtype)
    for k, part in enumerate(group):
        mask = part_of == k
        if bool(mask.any()) and rows[:1].numel():
            row_view(rows, 1)[mask] = row_view(part.leaves[leaf], 1).index_select(0, positions[mask] - bases[k])
    return rows
