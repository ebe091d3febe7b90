"""Stage 4, merge: one `Frames` per filename, ordered by ``frame_idx``.

A filename whose frames all came from one rank, already sorted and free of
duplicates, is returned as views of the received buffer (no copy). Otherwise
its pieces are concatenated and sorted. Identical duplicates (the padding of
``DistributedSampler``) are kept once and counted; conflicting ones raise.
"""

from __future__ import annotations

import torch

from .errors import DuplicateFrameError, ShapeMismatchError
from .frames import Frames, Layout, Part, byte_rows, rebuild

__all__ = ["merge"]

Piece = tuple[Part, int, int]  # (part, first row, count)


def merge(parts: list[Part]) -> tuple[dict[str, Frames], int]:
    """Merge the parts of every rank.

    Returns:
        ``({filename: Frames}, duplicates_dropped)``, filenames in sorted order.

    Raises:
        ShapeMismatchError: two ranks sent one filename with different layouts.
        DuplicateFrameError: one ``(filename, frame_idx)`` came with different values.
    """
    pieces: dict[str, list[Piece]] = {}
    for part in parts:
        start = 0
        for name, count in zip(part.files, part.counts, strict=True):
            pieces.setdefault(name, []).append((part, start, count))
            start += count
    out, dropped = {}, 0
    for name in sorted(pieces):
        group = pieces[name]
        layout = group[0][0].layout
        for part, _, _ in group[1:]:
            if part.layout != layout:
                raise ShapeMismatchError(
                    f"filename {name!r}: rank {group[0][0].rank} sent {layout.describe()} but rank {part.rank} "
                    f"sent {part.layout.describe()} (ranks {sorted({p.rank for p, _, _ in group})}); every frame "
                    "of a filename must have the same structure, shape and dtype"
                )
        out[name], n = _merge_one(name, layout, group)
        dropped += n
    return out, dropped


def _merge_one(name: str, layout: Layout, group: list[Piece]) -> tuple[Frames, int]:
    if len(group) == 1:
        part, s, n = group[0]
        idx = part.frame_idx[s : s + n]
        if n < 2 or bool((idx[1:] > idx[:-1]).all()):
            value = rebuild(layout, n, [t[s : s + n] for t in part.leaves], [v[s : s + n] for v in part.json])
            return Frames(frame_idx=idx, frames=value, batch_size=[n]), 0
    idx = torch.cat([p.frame_idx[s : s + n] for p, s, n in group])
    leaves = [torch.cat([p.leaves[j][s : s + n] for p, s, n in group]) for j in range(len(layout.leaves))]
    json = [[v for p, s, n in group for v in p.json[j][s : s + n]] for j in range(len(layout.nontensor))]
    order = torch.argsort(idx, stable=True)
    sorted_idx = idx[order]
    dup = sorted_idx[1:] == sorted_idx[:-1]
    keep = torch.ones_like(sorted_idx, dtype=torch.bool)
    if bool(dup.any()):
        first, second = order[:-1][dup], order[1:][dup]
        same = torch.ones_like(first, dtype=torch.bool)
        for t in leaves:
            rows = byte_rows(t)
            same &= (rows[first] == rows[second]).all(dim=1)
        for values in json:
            same &= torch.tensor(
                [values[a] == values[b] for a, b in zip(first.tolist(), second.tolist(), strict=True)], dtype=torch.bool
            )
        if not bool(same.all()):
            k = int((~same).nonzero()[0])
            a, b = int(first[k]), int(second[k])
            ra, rb = _rank_of(group, a), _rank_of(group, b)
            who = f"ranks {ra} and {rb}" if ra != rb else f"rank {ra} (twice)"
            raise DuplicateFrameError(
                f"filename {name!r}, frame_idx {int(idx[a])}: {who} sent different values. Identical "
                "duplicates (DistributedSampler padding) are dropped; different ones mean two predictions "
                "claim the same frame: check how frames are assigned to ranks"
            )
        keep[1:] = ~dup
    select = order[keep]
    count = select.numel()
    value = rebuild(layout, count, [t[select] for t in leaves], [[v[k] for k in select.tolist()] for v in json])
    return Frames(frame_idx=sorted_idx[keep], frames=value, batch_size=[count]), int(idx.numel() - count)


def _rank_of(group: list[Piece], row: int) -> int:
    for part, _, n in group:
        if row < n:
            return part.rank
        row -= n
    raise IndexError(row)
