"""What a `tdgather.storage.writer.DatasetWriter` keeps per filename until it writes the index: columnar.

Rank dst may write millions of filenames. A dict, a list and a segment dict per filename cost
about a kilobyte each; here a filename costs its name in one dict (name -> id) and a few array
slots, and each segment (a filename's rows in one shard) a few more, never a Python object:

- per filename: its layout (a number), its frame_idx written as one run ``lo..hi`` (or, when
  they form several runs, an int64 ``[k, 2]`` tensor in a side table), its first segment (its
  later ones, when it has several, in an array in a side table);
- per segment: shard, group, first row, frames, the rank that sent its frames (or `MIXED`: then
  each row's, int32, in one flat array of them all; `UNKNOWN`: an earlier attempt's).

A shard's filenames are recorded in one call (`add_shard`), and the index's ``files`` object is
written from these arrays about a megabyte at a time (`json_chunks`): a filename of one segment (the
usual case) as one formatted line, byte for byte what `json.dumps` writes, not as dicts.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Mapping, Sequence
from json.encoder import encode_basestring

import torch

from ..core.frames import Layout
from ..core.promote import common_layout
from ..core.runs import add_runs
from ..format.records import Segment

__all__ = ["MIXED", "UNKNOWN", "Catalog"]

UNKNOWN = -1  # a segment whose sender is not known here (an earlier attempt, another writer)
MIXED = -2  # a segment whose rows came from several ranks: see `Catalog.rank_rows`
_NONE = -1  # no segment
_CHUNK_FILES = 5000  # filenames per piece of the index's JSON (about a megabyte)


class Catalog:
    """Filenames written, their frames (as runs), segments and senders; see the module docstring."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self._layouts: list[Layout] = []
        self._layout_ids: dict[Layout, int] = {}
        self._layout = array("i")
        self._lo, self._hi = array("q"), array("q")  # the one run of frame_idx written, when one
        self._runs: dict[int, torch.Tensor] = {}  # filenames with several runs
        self._first = array("q")  # each filename's first segment
        self._more: dict[int, array] = {}  # filenames with several segments: the later ones
        self._shards: list[str] = []
        self._shard_ids: dict[str, int] = {}
        self._groups: list[str] = []
        self._group_ids: dict[str, int] = {}
        self._seg_start, self._seg_frames = array("q"), array("q")
        self._seg_shard, self._seg_group, self._seg_rank = array("i"), array("i"), array("i")
        self._seg_rows = array("q")  # MIXED segments: where their rows' ranks start in ``_rank_rows``
        self._rank_rows = array("i")  # MIXED segments' rank per row, one segment after another
        self._count = array("q")  # each filename's frames in its listed segments

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, name: object) -> bool:
        return name in self.ids

    def layout(self, name: str) -> Layout | None:
        """The layout ``name`` was written with (its segments' layouts joined, where they differ), or None."""
        i = self.ids.get(name)
        return None if i is None else self._layouts[self._layout[i]]

    def written(self, name: str) -> torch.Tensor:
        """The frame_idx of ``name`` written, as runs (int64 ``[k, 2]``, `tdgather.core.runs`)."""
        i = self.ids[name]
        runs = self._runs.get(i)
        return runs if runs is not None else torch.tensor([[self._lo[i], self._hi[i]]], dtype=torch.int64)

    def segments(self, name: str) -> list[dict]:
        """The segments of ``name``, in the order written: shard, group, start, frames, and their ``k``."""
        return [{**self._segment(s), "k": s} for s in self._segments_of(self.ids[name])]

    def _segments_of(self, i: int) -> list[int]:
        """Filename ``i``'s segments still listed, in the order written."""
        return [s for s in [self._first[i], *self._more.get(i, ())] if self._seg_shard[s] >= 0]

    def _segment(self, s: int) -> dict:
        shard, group = self._shards[self._seg_shard[s]], self._groups[self._seg_group[s]]
        return Segment(shard, group, self._seg_start[s], self._seg_frames[s]).to_json()

    def rank_rows(self, k: int) -> torch.Tensor:
        """Segment ``k``'s sender per row (int32), `UNKNOWN` where not known."""
        rank, n = self._seg_rank[k], self._seg_frames[k]
        if rank == MIXED:
            at = self._seg_rows[k]
            return torch.tensor(self._rank_rows[at : at + n], dtype=torch.int32)
        return torch.full((n,), rank, dtype=torch.int32)

    def ranks(self, name: str) -> list[int]:
        """Every known rank that sent frames of ``name`` already written, sorted."""
        found: set[int] = set()
        for seg in self.segments(name):
            found.update(r for r in self.rank_rows(seg["k"]).unique().tolist() if r >= 0)
        return sorted(found)

    def add(self, name: str, layout: Layout, segment: Mapping, idx: torch.Tensor, runs: tuple | None, rank) -> None:
        """Record ``segment`` (shard, group, start, frames) of ``name``: frames ``idx`` from ``rank``.

        ``runs`` is ``(lo, hi)`` when ``idx`` is the run ``lo..hi``, else None. ``rank`` is an int (every
        row's sender, `UNKNOWN` if not known) or an int32 tensor, one rank per row.
        """
        i = self._file(name, layout, idx, runs)
        self._append_segment(i, segment["shard"], segment["group"], segment["start"], segment["frames"], rank)

    def add_shard(self, shard: str, items: Sequence, segments: Sequence[tuple[str, int, int]]) -> None:
        """Record every item of shard ``shard`` (`tdgather.storage.shards.Item`s) at its ``(group, start, frames)``.

        The same as `add` for each. The items seen for the first time, whose frames are one run from
        one sender (the usual case), are recorded column by column (`extend`), a few list passes for
        them all (all of them, without a loop an item, when every item is); any other goes through `add`.
        """
        names = [item.name for item in items]
        runs, ranks = [item.runs for item in items], [item.rank for item in items]
        if None not in runs and set(map(type, ranks)) <= {int} and self._all_new(names):
            new, segs, slow = items, segments, []
        else:
            new, segs, slow = self._split_new(items, segments)
            names, runs, ranks = [i.name for i in new], [i.runs for i in new], [i.rank for i in new]
        self.extend(
            names,
            [item.layout for item in new],
            [shard] * len(names),
            [seg[0] for seg in segs],
            [seg[1] for seg in segs],
            [seg[2] for seg in segs],
            runs,
            ranks,
        )
        for item, (group, start, frames) in slow:
            segment = {"shard": shard, "group": group, "start": start, "frames": frames}
            self.add(item.name, item.layout, segment, item.idx, item.runs, item.rank)

    def _split_new(self, items: Sequence, segments: Sequence) -> tuple[list, list, list]:
        """The items `extend` takes (new here and in this call, one run, one sender), their segments; the rest."""
        new, segs, slow, fresh = [], [], [], set()  # fresh: names taken by this call (a name twice: `add`)
        for item, seg in zip(items, segments, strict=True):
            if (
                item.runs is not None
                and type(item.rank) is int
                and item.name not in self.ids
                and item.name not in fresh
            ):
                fresh.add(item.name)
                new.append(item), segs.append(seg)
            else:
                slow.append((item, seg))
        return new, segs, slow

    def _all_new(self, names: list[str]) -> bool:
        """Whether ``names`` are distinct and none is recorded yet."""
        return self.ids.keys().isdisjoint(names) and len(set(names)) == len(names)

    def _append_new(
        self,
        names: list[str],
        layouts: list[int],
        runs: list[tuple[int, int]],
        shards: list[int],
        groups: list[int],
        starts: list[int],
        frames: list[int],
        ranks: list[int],
    ) -> None:
        """New filenames, one segment each, column by column: what `add` records for each, in a few list passes."""
        n, s, k = len(self._first), len(self._seg_start), len(names)
        self.ids.update(zip(names, range(n, n + k), strict=True))
        self._first.frombytes(torch.arange(s, s + k, dtype=torch.int64).numpy().tobytes())
        _put(self._layout, layouts)
        _put(self._lo, [r[0] for r in runs])
        _put(self._hi, [r[1] for r in runs])
        _put(self._count, frames)
        _put(self._seg_frames, frames)
        _put(self._seg_start, starts)
        _put(self._seg_group, groups)
        _put(self._seg_shard, shards)
        _put(self._seg_rows, [len(self._rank_rows)] * k)
        _put(self._seg_rank, ranks)

    @staticmethod
    def _interned(values: list, table: list, ids: dict) -> list[int]:
        """Each of ``values``' numbers in ``table`` (added where new): a lookup where a value is not the one before.

        (Neighbours are usually one object: a layout is then not hashed again; all of them, one lookup.)
        """
        if values and values.count(values[0]) == len(values):  # one value (a shard's one group, one layout)
            return [_intern(values[0], table, ids)] * len(values)
        out, last, k = [], None, -1
        for v in values:
            if v is not last:
                last, k = v, _intern(v, table, ids)
            out.append(k)
        return out

    def _file(self, name: str, layout: Layout, idx: torch.Tensor, runs: tuple | None) -> int:
        """Filename ``name``'s number, made for a new one; its frame_idx written and layout updated by ``idx``."""
        i = self.ids.get(name)
        if i is None:
            i = self.ids[name] = len(self.ids)
            self._layout.append(self._intern_layout(layout))
            self._first.append(_NONE)
            self._count.append(0)
            lo, hi = runs if runs is not None else (0, -1)
            self._lo.append(lo), self._hi.append(hi)
            if runs is None:
                self._set_runs(i, add_runs(None, idx))
        else:
            self._set_runs(i, add_runs(self.written(name), idx))
            old = self._layouts[self._layout[i]]
            if layout != old:  # a layout that fits (`tdgather.core.promote.common_layout`): both joined
                self._layout[i] = self._intern_layout(common_layout(old, layout) or old)
        return i

    def _set_runs(self, i: int, runs: torch.Tensor) -> None:
        if runs.shape[0] == 1:
            self._lo[i], self._hi[i] = int(runs[0, 0]), int(runs[0, 1])
            self._runs.pop(i, None)
        else:
            self._runs[i] = runs

    def _append_segment(self, i: int, shard: str, group: str, start: int, frames: int, rank) -> None:
        s = len(self._seg_start)
        self._seg_shard.append(_intern(shard, self._shards, self._shard_ids))
        self._seg_group.append(_intern(group, self._groups, self._group_ids))
        self._seg_start.append(start)
        self._seg_frames.append(frames)
        self._seg_rows.append(len(self._rank_rows))
        if isinstance(rank, torch.Tensor):
            uniform = rank.numel() and bool((rank == rank[0]).all())
            self._seg_rank.append(int(rank[0]) if uniform else MIXED)
            if not uniform:
                self._rank_rows.frombytes(rank.to(torch.int32).contiguous().numpy().tobytes())
        else:
            self._seg_rank.append(int(rank))
        self._count[i] += frames
        if self._first[i] == _NONE:
            self._first[i] = s
        else:
            more = self._more.get(i)
            if more is None:
                more = self._more[i] = array("q")
            more.append(s)

    def _intern_layout(self, layout: Layout) -> int:
        return _intern(layout, self._layouts, self._layout_ids)

    def extend(
        self,
        names: list[str],
        layouts: list[Layout],
        shards: list[str],
        groups: list[str],
        starts: list[int],
        frames: list[int],
        runs: list[tuple[int, int]] | None = None,
        ranks: list[int] | None = None,
    ) -> None:
        """Filenames not recorded yet, one segment each, column by column.

        ``runs``: each one's frame_idx written, as ``(lo, hi)``; default: not known (``(0, -1)``), as
        for frames nothing later compares against (a writer's shards combined at close). ``ranks``:
        each one's sender; default: not known (`UNKNOWN`).
        """
        self._append_new(
            names,
            self._interned(layouts, self._layouts, self._layout_ids),
            [(0, -1)] * len(names) if runs is None else runs,
            self._interned(shards, self._shards, self._shard_ids),
            self._interned(groups, self._groups, self._group_ids),
            starts,
            frames,
            [UNKNOWN] * len(names) if ranks is None else ranks,
        )

    def load(
        self, files: Mapping[str, dict], layouts: Mapping[str, Layout], written: Mapping[str, torch.Tensor]
    ) -> None:
        """Take what earlier attempts saved (`tdgather.storage.runstate.RunState`'s files, layouts and runs).

        A filename new here with one segment and one run of frames (the usual case) is taken column by
        column (`extend`); any other one segment at a time.
        """
        fresh, rest = [], []
        for name, entry in files.items():
            runs, segs = written.get(name), entry["segments"]
            one = name not in self.ids and len(segs) == 1 and (runs is None or runs.shape[0] == 1)
            (fresh if one else rest).append(name)
        if fresh:
            segs = [files[name]["segments"][0] for name in fresh]
            spans = [written.get(name) for name in fresh]
            self.extend(
                fresh,
                [layouts[name] for name in fresh],
                [seg["shard"] for seg in segs],
                [seg["group"] for seg in segs],
                [seg["start"] for seg in segs],
                [seg["frames"] for seg in segs],
                [(0, -1) if r is None else tuple(r.tolist()[0]) for r in spans],
            )
        for name in rest:
            entry, runs = files[name], written.get(name)
            for seg in entry["segments"]:
                i = self.ids.get(name)
                if i is None:
                    i = self.ids[name] = len(self.ids)
                    self._layout.append(self._intern_layout(layouts[name]))
                    self._first.append(_NONE)
                    self._count.append(0)
                    self._lo.append(0), self._hi.append(-1)
                    if runs is not None:
                        self._set_runs(i, runs)
                self._append_segment(i, seg["shard"], seg["group"], seg["start"], seg["frames"], UNKNOWN)

    def drop_shards(self, shards: set[str]) -> None:
        """Forget the segments in ``shards`` (they never became durable); a filename left without any is not listed."""
        dead = {self._shard_ids[s] for s in shards if s in self._shard_ids}
        if not dead:
            return
        for s, shard in enumerate(self._seg_shard):
            if shard in dead:
                self._seg_shard[s] = -1
        for i in range(len(self._count)):
            self._count[i] = sum(self._seg_frames[s] for s in self._segments_of(i))

    def num_files(self) -> int:
        """Filenames with at least one segment."""
        return len(self._count) - self._count.count(0)

    def max_frames(self) -> int:
        """The most frames one filename has (0 when there is none)."""
        return max(self._count, default=0)

    def files(self) -> dict[str, dict]:
        """``{filename: {"frames", "segments"}}`` as the index lists them, built now (for inspection)."""
        return json.loads("".join(self.json_chunks()))

    def json_chunks(self) -> Iterator[str]:
        """The index's ``files`` object, filenames sorted, as `json.dumps` writes it, `_CHUNK_FILES` names a piece.

        A filename of one segment is one line formatted here (its name escaped by `json`'s own
        encoder); one of several, its entry as `json.dumps` writes it.
        """
        shards = [encode_basestring(name) for name in self._shards]
        groups = [encode_basestring(name) for name in self._groups]
        ids, count, first, more = self.ids, self._count, self._first, self._more
        shard, group, start, frames = self._seg_shard, self._seg_group, self._seg_start, self._seg_frames
        one = '%s: {"frames": %d, "segments": [{"shard": %s, "group": %s, "start": %d, "frames": %d}]}'
        names = sorted(ids) if 0 not in count else sorted(name for name, i in ids.items() if count[i])
        yield "{"
        for at in range(0, len(names), _CHUNK_FILES):
            piece = []
            for name in names[at : at + _CHUNK_FILES]:
                i = ids[name]
                s = first[i]
                if i in more or shard[s] < 0:
                    segs = [self._segment(k) for k in self._segments_of(i)]
                    entry = json.dumps({"frames": count[i], "segments": segs}, ensure_ascii=False)
                    piece.append(f"{encode_basestring(name)}: {entry}")
                else:
                    piece.append(
                        one
                        % (encode_basestring(name), count[i], shards[shard[s]], groups[group[s]], start[s], frames[s])
                    )
            yield ("" if at == 0 else ", ") + ", ".join(piece)
        yield "}"


def _put(column: array, values: list[int]) -> None:
    """Append ``values`` to ``column`` in one pass: a value repeated (the usual: one shard, group, sender) as one."""
    if values and values.count(values[0]) == len(values):
        column.extend(array(column.typecode, values[:1]) * len(values))
    else:
        column.fromlist(values if type(values) is list else list(values))


def _intern(value, values: list, ids: dict) -> int:
    k = ids.get(value)
    if k is None:
        k = ids[value] = len(values)
        values.append(value)
    return k
