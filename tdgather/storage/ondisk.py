"""Copies of frames already written, compared with the frames on disk: the copy on disk stays.

A filename may come in several writes (a Collector's spills, a resumed run's). Before
a write's frames go into shards, `tdgather.storage.writer.DatasetWriter` resolves the frames it
has written before, in this order:

1. `drop_written` leaves out of each `tdgather.storage.shards.Item` the frames the `Catalog` lists
   as written, and names them as copies to compare. A filename written before with a layout that
   does not fit (`tdgather.core.promote.common_layout`) raises `ShapeMismatchError` (or, with
   ``mismatches``, is recorded and left out);
2. once every shard written is in place, `compare_written` reads the frames those copies repeat
   back from disk, each shard's group once per window of rows (`_windows`), not once per filename,
   and compares them by the duplicates policy: it yields each window's counts of copies dropped,
   or raises the policy's error for the first copy refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..core.duplicates import DuplicateCounts, DuplicatePolicy, compare, conflict
from ..core.frames import Layout
from ..core.plan import Mismatches
from ..core.promote import SAME_LAYOUT, common_layout, promote_columns, ragged_hint
from ..core.runs import in_runs
from ..errors import ShapeMismatchError
from .catalog import Catalog
from .segments import cat_columns, read_segment
from .shards import Item, take
from .store import Store

__all__ = ["compare_written", "drop_written"]

_WINDOW_BYTES = 16 << 20  # rows of a shard's group read back at once to compare copies with


def drop_written(
    items: list[Item], catalog: Catalog, fixed: bool, mismatches: Mismatches | None
) -> tuple[list[Item], list[tuple[int, torch.Tensor]]]:
    """``items`` without the frames ``catalog`` lists as written, and the copies left out.

    Returns the items left (none empty) and, for each item with frames on disk, ``(k, again)``:
    its place in ``items`` and which of its frames are on disk (bool), for `compare_written`.
    ``fixed``: frames declared fixed, whose layout may not change (no common layout).

    Raises:
        ShapeMismatchError: a filename written before with a layout that does not fit (without ``mismatches``).
    """
    out: list[Item | None] = list(items)
    hits: list[tuple[int, torch.Tensor]] = []  # (item, which of its frames are on disk)
    ids = catalog.ids
    for k in [k for k, item in enumerate(items) if item.name in ids]:  # a new filename: nothing to look up
        item = items[k]
        layout = catalog.layout(item.name)
        if layout != item.layout and (fixed or common_layout(layout, item.layout) is None):
            if mismatches is None:
                raise _mismatch(catalog, item)
            mismatches.setdefault(item.name, (layout, _mismatch(catalog, item)))
            out[k] = None
            continue
        again = in_runs(catalog.written(item.name), item.idx)
        if bool(again.any()):
            hits.append((k, again))
            out[k] = take(item, (~again).nonzero().flatten())
    return [item for item in out if item is not None and item.n], hits


def compare_written(
    store: Store, catalog: Catalog, policy: DuplicatePolicy, items: list[Item], hits: list[tuple[int, torch.Tensor]]
) -> Iterator[DuplicateCounts]:
    """Compare the copies ``hits`` names with the frames on disk, a window of a shard's group at a time.

    Yields each window's counts of copies dropped, as it is compared.

    Raises:
        DuplicateFrameError: a copy the policy refuses (`tdgather.core.duplicates.conflict`).
    """
    by_group: dict[tuple[str, str], list[tuple[dict, int, torch.Tensor]]] = {}
    for k, again in hits:
        for seg in catalog.segments(items[k].name):
            by_group.setdefault((seg["shard"], seg["group"]), []).append((seg, k, again))
    for (shard, group), segs in by_group.items():
        # the copies of one group's rows, as one layout: every filename's, written and new, joined
        layout = items[segs[0][1]].layout
        for k in dict.fromkeys(k for _, k, _ in segs):
            for other in (items[k].layout, catalog.layout(items[k].name)):
                layout = common_layout(layout, other) or layout
        for lo, hi, window in _windows(segs, layout):
            window_seg = {"shard": shard, "group": group, "start": lo, "frames": hi - lo}
            old_idx, old_tensors, old_json = read_segment(store, window_seg, layout)
            counts = _compare_window(catalog, policy, items, window, lo, layout, old_idx, old_tensors, old_json)
            if counts is not None:
                yield counts


def _compare_window(
    catalog: Catalog,
    policy: DuplicatePolicy,
    items: list[Item],
    window: list,
    lo: int,
    layout: Layout,
    old_idx,
    old_tensors,
    old_json,
) -> DuplicateCounts | None:
    """The counts of the copies in ``window`` (rows from ``lo`` on disk) dropped; None where it has none."""
    new_rows, old_rows, where = [], [], []  # per copy: its item and row, the row on disk, its segment
    for seg, k, again in window:
        a = seg["start"] - lo
        on_disk = old_idx[a : a + seg["frames"]]
        idx = items[k].idx
        pos = (again & torch.isin(idx, on_disk)).nonzero().flatten()
        if pos.numel():
            new_rows.append((k, pos))
            old_rows.append(a + torch.searchsorted(on_disk, idx[pos]))
            where.extend((seg, k, p) for p in pos.tolist())
    if not new_rows:
        return None
    old_pos = torch.cat(old_rows)
    leaves, json_leaves = range(len(layout.leaves)), range(len(layout.nontensor))
    new = [
        promote_columns(items[k].layout, layout, [t.index_select(0, p) for t in items[k].tensors]) for k, p in new_rows
    ]
    new_tensors = [cat_columns([columns[j] for columns in new]) for j in leaves]
    new_json = [[items[k].json[j][i] for k, p in new_rows for i in p.tolist()] for j in json_leaves]
    verdict = compare(
        layout,
        new_tensors,
        [t.index_select(0, old_pos) for t in old_tensors],
        new_json,
        [[values[i] for i in old_pos.tolist()] for values in old_json],
        policy,
    )
    if bool(verdict.refused.any()):
        c = int(verdict.refused.nonzero()[0])
        seg, k, p = where[c]
        raise _conflict(catalog, policy, items[k], p, seg, int(old_pos[c]) - (seg["start"] - lo), verdict.describe(c))
    return verdict.counts


def _conflict(
    catalog: Catalog, policy: DuplicatePolicy, item: Item, pos: int, seg: dict, row: int, how: str
) -> Exception:
    """The error for copy ``pos`` of ``item``, refused against row ``row`` of segment ``seg`` on disk."""
    old = int(catalog.rank_rows(seg["k"])[row])
    new = item.rank if isinstance(item.rank, int) else int(item.rank[pos])
    first = f"rank {old}" if old >= 0 else "an earlier attempt of this run"
    later = f"later rank {new}" if new >= 0 else f"a later copy (from ranks {_ranks_in(item.rank)})"
    where = f" (the first copy was written to {seg['shard']} before this one arrived)"
    return conflict(item.name, int(item.idx[pos]), how, policy, f"{first} and {later}", where)


def _mismatch(catalog: Catalog, item: Item) -> ShapeMismatchError:
    old_layout, old_ranks = catalog.layout(item.name), catalog.ranks(item.name)
    before = f"from ranks {old_ranks}" if old_ranks else "an earlier attempt of this run"
    return ShapeMismatchError(
        f"filename {item.name!r}: frames already written ({before}) have "
        f"{old_layout.describe()}, new ones (from ranks {_ranks_in(item.rank)}) have {item.layout.describe()}; "
        f"{SAME_LAYOUT}"
        f"{ragged_hint(old_layout, item.layout)}"
    )


def _ranks_in(rank: Any) -> list[int]:
    """The known ranks an `Item.rank` names."""
    ranks = rank.unique().tolist() if isinstance(rank, torch.Tensor) else [rank]
    return [r for r in ranks if r >= 0]


def _windows(segs: list[tuple[dict, int, Any]], layout: Layout) -> Iterator[tuple[int, int, list]]:
    """``segs`` (of one shard's group) by start, in windows of rows ``lo:hi`` of at most `_WINDOW_BYTES`."""
    most = max(1, _WINDOW_BYTES // max(1, layout.frame_nbytes))
    window: list = []
    lo = hi = 0
    for seg in sorted(segs, key=lambda s: s[0]["start"]):
        start, end = seg[0]["start"], seg[0]["start"] + seg[0]["frames"]
        if window and end - lo > most:
            yield lo, hi, window
            window = []
        if not window:
            lo = hi = start
        window.append(seg)
        hi = max(hi, end)
    if window:
        yield lo, hi, window
