"""A shard's own record read back and checked, its segments as columns.

Every shard records in its ``__metadata__`` its name, run, attempt, groups and segments (filename,
group, first row, frames). `read_record` checks all of it as `tdgather.open` checks a dataset
(header, groups, rows) and gives the segments as four lists, not a dict per filename: resuming a
run, or combining several writers' shards, reads hundreds of thousands of them.

Each segment holds at least one frame, and a filename is in a group of a shard once (tdgather
writes a filename's frames in one shard as one run of its group's rows). The segments of the
usual record (one group, every item well typed, each segment the next rows) are checked a list
pass a column; any other record is checked one segment at a time, which also names the segment
at fault.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import NamedTuple

from ..core.frames import Layout
from ..format.check import Check, check_group, check_layout, load_json, names_in, shard_groups
from .segments import open_shard
from .store import Store

__all__ = ["Record", "read_record"]

_MAX = 2**62  # a start or a frame count read from disk (`FieldCheck.int`'s bound)
_DECIMAL = re.compile(r"[1-9][0-9]*")  # as `str(int)` writes a positive one: no sign, no leading 0, ASCII only


class Record(NamedTuple):
    """One shard's record, checked: its header's facts and its segments, column by column."""

    run: str
    attempt: int
    groups: dict  # the groups' descriptions as stored (JSON)
    layouts: dict[str, Layout]  # each group's layout
    rows: dict[str, int]  # each group's rows
    nbytes: int  # its frames' tensor bytes
    filenames: list[str]
    segment_groups: list[str]
    starts: list[int]
    frames: list[int]


def read_record(store: Store, name: str, required: bool = True) -> Record | None:
    """Shard ``name``'s record, checked; None for a shard of an older tdgather (no record) unless ``required``.

    Raises:
        DatasetError: a header, a group or a segment that is not as this shard's writer wrote it (the
            shard renamed, a segment outside its group's rows, rows no segment covers).
    """
    c = Check(store.path(name))
    with open_shard(store, name, Check(store.where), "shard") as f:
        meta = f.metadata() or {}
        record = meta.get("segments")
        if record is None:
            if not required:
                return None
            raise c.fail(
                "__metadata__.segments",
                "the shard's record of its segments, which tdgather writes since index version 3 (an older "
                "tdgather's run cannot be resumed: read it with tdgather.open(path, incomplete=True), or rerun "
                "with overwrite=True)",
                None,
            )
        if meta.get("shard") != name:
            raise c.fail("__metadata__.shard", f"{name!r} (its own name: shard files were renamed)", meta.get("shard"))
        run = c.str(meta.get("run"), "__metadata__.run")
        attempt = meta.get("attempt", "")
        if not (_DECIMAL.fullmatch(attempt) and int(attempt) < 1 << 31):
            raise c.fail("__metadata__.attempt", "a positive integer, in decimal digits", attempt)
        raw = shard_groups(f, c)
        layouts = {g: check_layout(desc, c, f"__metadata__.groups[{g!r}]") for g, desc in raw.items()}
        rows = {g: check_group(f, c, g, layout) for g, layout in layouts.items()}
        segments = c.list(load_json(c.str(record, "__metadata__.segments"), c, "__metadata__.segments"), "segments")
        columns = _columns(segments, rows) or _one_by_one(c, segments, rows)
        nbytes = 0
        for g, layout in layouts.items():
            nbytes += rows[g] * layout.frame_nbytes
            for leaf, tensor in zip(layout.leaves, names_in(f, c, g, layout).leaves, strict=True):
                if leaf.ragged:
                    nbytes += f.get_slice(tensor).get_shape()[0] * leaf.row_nbytes
    return Record(run, int(attempt), raw, layouts, rows, nbytes, *columns)


def _columns(segments: list, rows: dict[str, int]) -> tuple[list, list, list, list] | None:
    """The usual record's columns, checked a pass a column; None for any other (`_one_by_one` decides)."""
    if not segments or not all(type(s) is list and len(s) == 4 for s in segments):
        return None
    filenames, groups, starts, frames = ([s[k] for s in segments] for k in range(4))
    group = groups[0]
    if (
        group not in rows
        or groups.count(group) != len(groups)
        or set(map(type, filenames)) != {str}
        or set(map(type, frames)) != {int}
        or set(map(type, starts)) != {int}
        or not 0 < min(frames) <= max(frames) <= _MAX
        or len(set(filenames)) != len(filenames)
        or starts != list(accumulate(frames[:-1], initial=0))  # each the next rows
        or starts[-1] + frames[-1] != rows[group]
        or any(n for g, n in rows.items() if g != group)  # every row covered
    ):
        return None
    return filenames, groups, starts, frames


def _one_by_one(c: Check, segments: list, rows: dict[str, int]) -> tuple[list, list, list, list]:
    """Any record's columns, checked a segment at a time; the first fault raises, naming its segment."""
    filenames, groups, starts, frames = [], [], [], []
    covered = dict.fromkeys(rows, 0)
    seen: dict[tuple[str, str], int] = {}
    for i, seg in enumerate(segments):
        sf = f"__metadata__.segments[{i}]"
        filename, group, start, count = c.list(seg, sf, 4)
        c.str(filename, f"{sf}[0]"), c.int(start, f"{sf}[2]"), c.int(count, f"{sf}[3]")
        if count == 0:
            raise c.fail(f"{sf}[3]", "at least 1 frame (tdgather writes no empty segment)", count)
        if group not in rows or start != covered[group]:
            raise c.fail(sf, f"the next rows of a group of this shard ({sorted(rows)})", seg)
        if (filename, group) in seen:
            k = seen[filename, group]
            raise c.fail(sf, f"a filename once in a group (segments[{k}] holds {filename!r} in {group!r})", seg)
        seen[filename, group] = i
        covered[group] += count
        filenames.append(filename), groups.append(group), starts.append(start), frames.append(count)
    if covered != rows:
        raise c.fail("__metadata__.segments", f"segments that cover every row ({rows})", covered)
    return filenames, groups, starts, frames
