"""Copies of one frame held by several writers' shards, resolved when the coordinator writes the index.

Copies across writers are resolved at close, not at read time, so that the dataset on disk is
the same as a single writer's: each frame once, readable by plain safetensors readers that
follow the index, and a duplicates policy that refuses a copy fails the run, as it does with one
writer. The copy kept is the first by (attempt, writer, shard, row): an earlier attempt's copy
stays (as with one writer, where the copy on disk stays), and within an attempt the lowest
writer's, which holds the lowest ranks, so the frames kept are those a single writer keeps. A
copy dropped stays in its shard, listed by no segment. An append's commit resolves a job's copies
of frames the dataset already holds the same way (`tdgather.storage.append.merge`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..core.duplicates import DuplicateCounts, DuplicatePolicy, compare, conflict
from ..core.frames import Layout
from ..core.promote import SAME_LAYOUT, common_layout, ragged_hint
from ..errors import DatasetError, ShapeMismatchError
from ..format.names import shard_numbers
from .segments import cat_columns, read_segment
from .store import Store

__all__ = ["resolve"]


def resolve(
    store: Store,
    files: dict[str, dict],
    layout_of: Mapping[tuple[str, str], Layout],
    order_of: Mapping[str, tuple],
    frame_idx: Any,
    policy: Any,
    fixed: bool = False,
    source: Callable[[str], str] | None = None,
    fix: str | None = None,
) -> tuple[DuplicateCounts, dict[str, list[int]]]:
    """Keep the first copy of every frame held by several shards' sources; drop the rest from ``files``.

    Args:
        store: where the shards are.
        files: ``{filename: {"frames", "segments"}}`` from the shards' records; changed in place: a
            segment that holds dropped copies is split around them.
        layout_of: each ``(shard, group)``'s layout.
        order_of: each shard's precedence (`shard_order`); shards with the same first two
            (attempt, writer) are one source, which never holds a frame twice.
        frame_idx: ``frame_idx(shard, group)``: the group's frame indexes (int64).
        policy: the duplicates policy; a copy it refuses raises `DuplicateFrameError`.
        fixed: frames declared fixed (``ragged=False``): a filename's segments may not differ in a
            leaf's first dim (else they may: the leaf reads as ragged).
        source: ``source(shard)``: who sent a shard's copies, as the refusal names them (default: its
            writer, ``writer 1 (shard-00001-00000.safetensors)``); an append names jobs instead.
        fix: what the refusal tells the user to do (default: `tdgather.core.duplicates.conflict`'s, for
            copies within one run).

    Returns:
        The copies dropped, counted, and per shard the ``[frames, bytes]`` dropped from it.

    Raises:
        ShapeMismatchError: one filename with two layouts that do not fit (`tdgather.core.promote.common_layout`).
        DatasetError: a source holds a frame twice (a shard edited by hand).
    """
    policy = DuplicatePolicy.of(policy)
    kind: dict[Layout, int] = {}
    kind_of = {key: kind.setdefault(layout, len(kind)) for key, layout in layout_of.items()}
    candidates = []  # filenames with segments of several sources: those may hold copies
    for name, entry in files.items():
        segments = entry["segments"]
        if len(segments) < 2:
            continue
        if len({kind_of[s["shard"], s["group"]] for s in segments}) > 1 and _joined(segments, layout_of, fixed) is None:
            raise _two_layouts(name, segments, layout_of)
        if len({order_of[s["shard"]][:2] for s in segments}) > 1:
            candidates.append(name)
    counts, dropped = DuplicateCounts(), {}
    refusal = (source or _writer, fix)
    for name in _holding_copies(candidates, files, frame_idx):
        counts += _resolve_one(store, name, files[name], layout_of, order_of, frame_idx, policy, dropped, refusal)
    return counts, dropped


def _joined(segments: list[dict], layout_of: Mapping, fixed: bool = False) -> Layout | None:
    """The one layout of ``segments``: theirs, or (not ``fixed``) theirs joined; None when they do not fit."""
    first = layout_of[segments[0]["shard"], segments[0]["group"]]
    for s in segments[1:]:
        layout = layout_of[s["shard"], s["group"]]
        if layout != first:
            first = None if fixed else common_layout(first, layout)
            if first is None:
                return None
    return first


def _two_layouts(name: str, segments: list[dict], layout_of: Mapping) -> ShapeMismatchError:
    first = layout_of[segments[0]["shard"], segments[0]["group"]]
    other = next(s for s in segments if layout_of[s["shard"], s["group"]] != first)
    layout = layout_of[other["shard"], other["group"]]
    return ShapeMismatchError(
        f"filename {name!r}: frames in {segments[0]['shard']} have {first.describe()}, frames in "
        f"{other['shard']} (another writer) have {layout.describe()}; {SAME_LAYOUT}"
        f"{ragged_hint(first, layout)}"
    )


def _holding_copies(names: list[str], files: Mapping[str, dict], frame_idx: Any) -> list[str]:
    """The filenames of ``names`` whose segments hold a frame twice: one sort over all their frames."""
    if not names:
        return []
    offset: dict[tuple[str, str], int] = {}  # each group's frame indexes, back to back in ``base``
    columns, starts, lengths, owner, end = [], [], [], [], 0
    for k, name in enumerate(names):
        for s in files[name]["segments"]:
            key = s["shard"], s["group"]
            if key not in offset:
                offset[key] = end
                columns.append(frame_idx(*key))
                end += len(columns[-1])
            starts.append(offset[key] + s["start"])
            lengths.append(s["frames"])
            owner.append(k)
    base, length = torch.cat(columns), torch.tensor(lengths)
    first = torch.repeat_interleave(torch.tensor(starts) - (length.cumsum(0) - length), length)
    idx = base[first + torch.arange(int(length.sum()))]  # every segment's frame indexes, no slice per segment
    file = torch.repeat_interleave(torch.tensor(owner), length)
    order = torch.argsort(idx, stable=True)
    order = order[torch.argsort(file[order], stable=True)]  # by filename, then frame
    f, i = file[order], idx[order]
    twice = (f[1:] == f[:-1]) & (i[1:] == i[:-1])
    return [names[k] for k in f[1:][twice].unique().tolist()]


def _resolve_one(store, name, entry, layout_of, order_of, frame_idx, policy, dropped, refusal) -> DuplicateCounts:
    """One filename's copies: the first by precedence kept, the others compared, counted and split out.

    ``refusal``: ``(source, fix)``, how a copy the policy refuses is named (`resolve`).
    """
    segments = sorted(entry["segments"], key=lambda s: (order_of[s["shard"]], s["start"]))
    idx = [frame_idx(s["shard"], s["group"])[s["start"] : s["start"] + s["frames"]] for s in segments]
    flat = torch.cat(idx)
    which = torch.repeat_interleave(torch.arange(len(idx)), torch.tensor([len(x) for x in idx]))
    order = torch.argsort(flat, stable=True)  # equal frames: the first source's copy first
    repeat = torch.zeros(len(flat), dtype=torch.bool)
    repeat[1:] = flat[order][1:] == flat[order][:-1]
    first = torch.arange(len(flat)).masked_fill(repeat, 0).cummax(0).values  # each copy's first, in order
    later, kept = order[repeat], order[first[repeat]]
    for a, b in zip(which[later].tolist(), which[kept].tolist(), strict=True):
        if order_of[segments[a]["shard"]][:2] == order_of[segments[b]["shard"]][:2]:
            where = store.path(segments[a]["shard"])
            raise DatasetError(where, f"files[{name!r}]", "expected each frame once, got a frame in two segments")
    verdict, nbytes = _compare(store, name, segments, idx, which, later, kept, layout_of, policy, refusal)
    for k, size in zip(which[later].tolist(), nbytes.tolist(), strict=True):
        shard = dropped.setdefault(segments[k]["shard"], [0, 0])
        shard[0] += 1
        shard[1] += size
    drop = torch.zeros(len(flat), dtype=torch.bool)
    drop[later] = True
    entry["segments"] = _split(segments, drop, [len(x) for x in idx])
    entry["frames"] = sum(s["frames"] for s in entry["segments"])
    return verdict


def _compare(
    store, name, segments, idx, which, later, kept, layout_of, policy, refusal
) -> tuple[DuplicateCounts, torch.Tensor]:
    """Read the rows of each copy dropped and of the copy kept (a span per segment), and compare them.

    Returns the counts, and each dropped copy's bytes.
    """
    starts = torch.tensor([0] + [len(x) for x in idx]).cumsum(0)
    involved = sorted({*which[later].tolist(), *which[kept].tolist()})
    layout = _joined(segments, layout_of)  # they fit (`resolve`): read as one layout
    tensors, json_values, base, at = [], [], {}, 0
    for k in involved:
        rows = torch.cat([later[which[later] == k], kept[which[kept] == k]]) - starts[k]
        lo, hi = int(rows.min()), int(rows.max()) + 1
        seg = segments[k]
        span = {"shard": seg["shard"], "group": seg["group"], "start": seg["start"] + lo, "frames": hi - lo}
        _, t, j = read_segment(store, span, layout)
        tensors.append(t)
        json_values.append(j)
        base[k] = at - int(starts[k]) - lo  # a row of the concatenation, less its row in ``flat``
        at += hi - lo
    cat = [cat_columns([t[j] for t in tensors]) for j in range(len(layout.leaves))]
    values = [[v for j in json_values for v in j[m]] for m in range(len(layout.nontensor))]
    pos = lambda rows: torch.tensor([r + base[int(which[r])] for r in rows.tolist()], dtype=torch.int64)  # noqa: E731
    new, old = pos(later), pos(kept)
    copies = [t.index_select(0, new) for t in cat]
    verdict = compare(
        layout,
        copies,
        [t.index_select(0, old) for t in cat],
        [[v[r] for r in new.tolist()] for v in values],
        [[v[r] for r in old.tolist()] for v in values],
        policy,
    )
    if bool(verdict.refused.any()):
        k = int(verdict.refused.nonzero()[0])
        a, b = segments[int(which[later[k]])]["shard"], segments[int(which[kept[k]])]["shard"]
        frame = int(torch.cat(idx)[later[k]])
        source, fix = refusal
        raise conflict(name, frame, verdict.describe(k), policy, f"{source(b)} and {source(a)}", fix=fix)
    nbytes = torch.full((len(new),), layout.frame_nbytes, dtype=torch.int64)
    for leaf, t in zip(layout.leaves, copies, strict=True):
        if leaf.ragged:
            nbytes += t.offsets.diff() * leaf.row_nbytes
    return verdict.counts, nbytes


def _writer(shard: str) -> str:
    """Who sent a shard's copies, within one run: its writer (rank dst's, for the single writer's shards)."""
    writer = shard_numbers(shard)[0]
    return f"rank dst ({shard})" if writer is None else f"writer {writer} ({shard})"


def _split(segments: list[dict], drop: torch.Tensor, lengths: list[int]) -> list[dict]:
    """The segments without the rows ``drop`` marks (over their rows, back to back): kept runs only."""
    out, at = [], 0
    for seg, n in zip(segments, lengths, strict=True):
        mask = drop[at : at + n]
        at += n
        if not bool(mask.any()):
            out.append(seg)
            continue
        keep = torch.cat([torch.tensor([False]), ~mask, torch.tensor([False])]).to(torch.int8).diff()
        for lo, hi in zip(
            (keep == 1).nonzero().flatten().tolist(), (keep == -1).nonzero().flatten().tolist(), strict=True
        ):
            out.append({**seg, "start": seg["start"] + lo, "frames": hi - lo})
    return out
