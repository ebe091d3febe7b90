"""Checks of a saved dataset before it is used: nothing on disk is trusted.

The index is checked whole when a dataset is opened (it is already in memory): strict
JSON, every field's type, shard names, groups, segments, and that every count agrees.
A shard's header is checked the first time the shard is touched: its ``__metadata__``,
and each group's tensors (dtype, shape, rows) against the layout the index gives.
Values (JSON offsets and lines) are checked as they are read, so reading one filename
still reads only its rows. Every refusal is a `DatasetError` naming the file and field.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..core.checks import FieldCheck, decode_layout, strict_json
from ..core.dtypes import SAFETENSORS_CODE, dtype_name
from ..core.frames import Layout
from ..core.promote import common_layout, schema, type_of
from ..errors import DatasetError
from .names import (
    FORMAT,
    INDEX_VERSION,
    RAGGED_VERSION,
    RUN_TAG,
    SCHEMA_VERSION,
    SHARD_NAME,
    SHARD_VERSIONS,
    VERSIONS,
    GroupNames,
    group_names,
    shard_run,
)
from .records import Failure, FileEntry, Segment, ShardEntry, SnapshotRecord

__all__ = [
    "Check",
    "IndexPlan",
    "check_group",
    "names_in",
    "check_index",
    "check_layout",
    "check_run",
    "check_segment",
    "check_shard",
    "index_run",
    "json_scalar",
    "key",
    "load_json",
    "shard_groups",
    "shard_version",
]

_DTYPE_OF_CODE = {code: dtype_name(dt) for dt, code in SAFETENSORS_CODE.items()}
_SCALARS = (str, int, float, bool, type(None))


class Check(FieldCheck):
    """`FieldCheck` for a file on disk: the same typed field access, raising `DatasetError`."""

    def __init__(self, file: str | os.PathLike) -> None:
        self.file = str(file)

    def fail(self, field: str, expected: str, got: Any) -> DatasetError:  # type: ignore[override]
        """The error for ``field`` of this file."""
        return DatasetError(self.file, field, f"expected {expected}, got {got!r:.120}")

    def mapping(self, x: Any, field: str) -> dict:
        """A JSON object with any keys (`obj` wants exactly some)."""
        if not isinstance(x, dict):
            raise self.fail(field, "an object", x)
        return x


def key(name: str) -> str:
    """A filename as shown in a field name: quoted, long ones cut."""
    return f"[{name[:40]!r}{'...' if len(name) > 40 else ''}]"


def load_json(raw: bytes | str, c: Check, field: str) -> Any:
    """Parse strictly: UTF-8, no NaN or Infinity, no duplicate keys (deep nesting is refused, not a crash)."""
    try:
        return strict_json(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DatasetError(c.file, field, f"expected strict UTF-8 JSON (no NaN, no duplicate keys), got {e}") from e


def json_scalar(line: bytes, c: Check, field: str) -> Any:
    """One JSON line of a shard: a str, int, finite float, bool or null."""
    value = load_json(line, c, field)
    if not isinstance(value, _SCALARS) or (isinstance(value, float) and not math.isfinite(value)):
        raise c.fail(field, "a JSON scalar (str, int, finite float, bool or null)", value)
    return value


def check_layout(obj: Any, c: Check, field: str) -> Layout:
    """A group description, validated as the wire validates one (`tdgather.comm.wire`)."""
    return decode_layout(obj, c, field)


def check_segment(seg: Any, c: Check, field: str) -> tuple[str, str, int, int]:
    """A segment's ``(shard, group, start, frames)``, each of the right type (`Segment.from_json`)."""
    return Segment.check(seg, c, field)


@dataclass(frozen=True)
class IndexPlan:
    """What the index promises, once checked.

    Attributes:
        layouts: each filename's layout (of all its segments: joined, where their layouts differ in first dims).
        groups: each ``(shard, group)``'s layout.
        needs: per ``(shard, group)``, the rows its segments reach and the field of the segment reaching furthest.
        schema: the dataset's frame types: the index's ``schema`` (version 8 on), else what
            `tdgather.core.promote.schema` makes of the groups (a leaf ragged anywhere, or whose
            first dim differs between two frames, is ragged in every type).
        types: each layout of ``groups`` and ``layouts``, and the type of ``schema`` its frames read as.
    """

    layouts: dict[str, Layout]
    groups: dict[tuple[str, str], Layout]
    needs: dict[tuple[str, str], tuple[int, str]]
    schema: tuple[Layout, ...] = ()
    types: dict[Layout, Layout] = dataclasses.field(default_factory=dict)

    @property
    def ragged(self) -> frozenset[str]:
        """The leaves (dotted) ragged in some type of the schema."""
        return frozenset(".".join(x.path) for t in self.schema for x in t.leaves if x.ragged)


def check_index(index: Any, file: str, incomplete: bool) -> IndexPlan:
    """Check a parsed index: structure, types, references, and that every count agrees."""
    c = Check(file)
    c.mapping(index, "index")
    if index.get("format") != FORMAT:
        raise c.fail("format", repr(FORMAT), index.get("format"))
    version = index.get("version")
    if type(version) is not int or version not in VERSIONS:
        wanted = ", ".join(map(str, VERSIONS[:-1])) + f" or {VERSIONS[-1]}"
        raise c.fail("version", f"{wanted} (this tdgather reads index version {wanted} only)", version)
    top = {"format", "version", "metadata", "shards", "files"}
    if version >= SCHEMA_VERSION:  # a snapshot of a dataset jobs append to also says which (`SnapshotRecord`)
        top |= {"schema", "snapshot"} if "snapshot" in index else {"schema"}
    c.obj(index, "index", top)
    if "snapshot" in top:
        SnapshotRecord.from_json(index["snapshot"], c, "snapshot")
    meta = c.mapping(index["metadata"], "metadata")  # user keys are the user's: only ours are checked
    totals = {k: c.int(meta.get(k), f"metadata.{k}") for k in ("total_frames", "total_bytes", "num_filenames")}
    if incomplete:
        Failure.from_json(meta.get("failure"), c, "metadata.failure")
    groups: dict[tuple[str, str], Layout] = {}
    shards = c.mapping(index["shards"], "shards")
    for name, shard in shards.items():
        f = f"shards{key(name)}"
        if not SHARD_NAME.fullmatch(name):
            raise c.fail(f, "a shard file name like 'shard-00000.safetensors' (no directory)", name)
        for g, layout in ShardEntry.from_json(shard, c, f).groups.items():
            groups[name, g] = layout
    layouts: dict[str, Layout] = {}
    ranges: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    sizes = {where: (layout.frame_nbytes, layout.ragged) for where, layout in groups.items()}  # once a group
    frames_in = dict.fromkeys(shards, 0)
    bytes_in = dict.fromkeys(shards, 0)  # of fixed leaves; ragged values add what the segments cannot tell
    ragged_in: set[str] = set()
    joins: set[Layout] = set()  # the layouts of filenames whose segments' layouts differ
    for name, entry in c.mapping(index["files"], "files").items():
        f = f"files{key(name)}"
        frames, segments = FileEntry.check(entry, c, f)
        total = 0
        for i, (shard, g, start, count) in enumerate(segments):
            sf = f"{f}.segments[{i}]"
            if shard not in shards:
                raise c.fail(f"{sf}.shard", "a shard listed in 'shards'", shard)
            if (shard, g) not in groups:
                raise c.fail(f"{sf}.group", f"a group of {shard} ({sorted(shards[shard]['groups'])})", g)
            layout = layouts.setdefault(name, groups[shard, g])
            if groups[shard, g] != layout:  # from version 6, layouts that fit (one leaf's first dim) join
                both = common_layout(layout, groups[shard, g]) if version >= RAGGED_VERSION else None
                if both is None:
                    fit = " (or one that differs only in a leaf's first dim)" if version >= RAGGED_VERSION else ""
                    raise c.fail(f"{sf}.group", f"the layout of the earlier segments, {layout.describe()}{fit}", g)
                layouts[name] = both
                joins.add(both)
            ranges.setdefault((shard, g), []).append((start, start + count, sf))
            frame_nbytes, ragged = sizes[shard, g]
            frames_in[shard] += count
            bytes_in[shard] += count * frame_nbytes
            if ragged:
                ragged_in.add(shard)
            total += count
        if name not in layouts:
            raise c.fail(f"{f}.segments", "at least one segment", [])
        if frames != total:
            raise c.fail(f"{f}.frames", f"{total}, the sum of its segments' frames", frames)
    needs = {}
    for (shard, g), spans in ranges.items():
        needs[shard, g] = max((end, field) for _, end, field in spans)
        spans = sorted(s for s in spans if s[1] > s[0])  # an empty segment overlaps nothing
        for (_, end, other), (start, _, field) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise c.fail(f"{field}.start", f"a start >= {end}, where {other} of the same group ends", start)
    for name, shard in shards.items():
        if shard["frames"] != frames_in[name]:
            raise c.fail(f"shards{key(name)}.frames", f"{frames_in[name]}, the sum over its segments", shard["frames"])
        fixed = bytes_in[name]
        if shard["bytes"] != fixed and not (name in ragged_in and shard["bytes"] > fixed):
            expected = f"{'at least ' if name in ragged_in else ''}{fixed}, the sum over its segments"
            raise c.fail(f"shards{key(name)}.bytes", expected, shard["bytes"])
    for what, want in (
        ("total_frames", sum(frames_in.values())),
        ("total_bytes", sum(s["bytes"] for s in shards.values())),
        ("num_filenames", len(layouts)),
    ):
        if totals[what] != want:
            raise c.fail(f"metadata.{what}", f"{want}, as the shards and files say", totals[what])
    stored = {*groups.values(), *joins}
    if version >= SCHEMA_VERSION:
        types = [check_layout(x, c, f"schema[{k}]") for k, x in enumerate(c.list(index["schema"], "schema"))]
    else:
        types = list(schema(stored))
    return IndexPlan(layouts, groups, needs, tuple(types), _types_of(stored, types, c))


def _types_of(stored: set[Layout], types: list[Layout], c: Check) -> dict[Layout, Layout]:
    """Each stored layout's one type of ``types``; every type must be some layout's."""
    out = {}
    for layout in stored:
        fits = type_of(layout, types)
        if len(fits) != 1:
            what = "none" if not fits else " and ".join(t.describe() for t in fits)
            raise c.fail("schema", f"one type that frames stored as {layout.describe()} read as", what)
        out[layout] = fits[0]
    for k, t in enumerate(types):
        if t not in out.values():
            raise c.fail(f"schema[{k}]", "a type some group's frames read as", t.describe())
    if len(set(types)) != len(types):
        raise c.fail("schema", "distinct types", [t.describe() for t in types])
    return out


def shard_groups(f: Any, c: Check) -> dict:
    """A shard's ``__metadata__``: its format and its group descriptions (not yet validated)."""
    meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise c.fail("__metadata__.format", repr(FORMAT), meta.get("format"))
    return c.mapping(load_json(c.str(meta.get("groups"), "__metadata__.groups"), c, "__metadata__.groups"), "groups")


def shard_version(f: Any, c: Check) -> int:
    """How an open shard names its tensors: the version its ``__metadata__`` records (none: 1)."""
    version = (f.metadata() or {}).get("version", "1")
    if version not in SHARD_VERSIONS:
        raise c.fail("__metadata__.version", " or ".join(map(repr, SHARD_VERSIONS)), version)
    return int(version)


def names_in(f: Any, c: Check, group: str, layout: Layout) -> GroupNames:
    """The tensor names of a group in an open shard: by the version its ``__metadata__`` records (none: 1)."""
    return group_names(group, layout, shard_version(f, c))


def index_run(index: dict, c: Check) -> str | None:
    """The run a checked index lists (``metadata.run``, written since index version 3); None for an older index."""
    if index["version"] < INDEX_VERSION:
        return None
    return c.str(index["metadata"].get("run"), "metadata.run")


def check_run(f: Any, c: Check, run: str | None, shard: str = "") -> None:
    """Refuse an open shard of another run than the index's (``run``; None: an index older than version 3).

    A shard whose name carries its run (``shard-00000.<run>-<attempt>.safetensors``: an object
    store's, and every appending job's) must be of that run instead: a snapshot lists the shards
    of many jobs.

    Shard names repeat from run to run (``shard-00000.safetensors``...): a shard whose
    ``__metadata__.run`` differs was written by another run, in a rewrite (``overwrite=True``)
    after the index was read. Its rows are never read under the index's filenames. A shard that
    records no run (an older tdgather's, also one a resumed run linked in) is accepted; so, where
    neither records a run (a version 1 or 2 dataset rewritten by a tdgather of that age), a
    rewrite is caught only when the shard's groups or tensors disagree with the index.
    """
    got = (f.metadata() or {}).get("run")
    tagged = shard_run(shard) if shard else ""
    if tagged and got is not None and got[:RUN_TAG] != tagged:
        raise DatasetError(
            c.file, "__metadata__.run", f"expected a run starting {tagged!r}, as its name says, got {got!r:.80}"
        )
    if tagged:
        return
    if got is not None and got != run:
        want = f"run {run!r}, the index's" if run is not None else "no run, as in an index older than version 3"
        raise DatasetError(
            c.file,
            "__metadata__.run",
            f"expected {want}, got {got!r:.80}: this file belongs to another run; the dataset was rewritten "
            "(overwrite=True) since it was opened: open it again",
        )


def check_group(f: Any, c: Check, group: str, layout: Layout) -> int:
    """Check one group's tensors in a shard header against ``layout``; return its rows ``N``."""
    names = set(f.keys())
    tensor_names = names_in(f, c, group, layout)

    def tensor(name: str, dtype: torch.dtype, shape: tuple = (), rows: int | None = None) -> Any:
        got = f.get_slice(name) if name in names else None
        code, dims = (got.get_dtype(), tuple(got.get_shape())) if got is not None else (None, ())
        want = (rows if rows is not None else "N", *shape)  # N: any number of rows
        if (
            code != SAFETENSORS_CODE[dtype]
            or len(dims) != len(want)
            or dims[1:] != shape
            or rows not in (None, *dims[:1])
        ):
            has = "no such tensor" if got is None else f"{_DTYPE_OF_CODE.get(code, code)}{list(dims)}"
            raise c.fail(name, f"{dtype_name(dtype)}[{', '.join(map(str, want))}]", has)
        return got

    def blob(name: str, dtype: torch.dtype, shape: tuple, what: str) -> None:  # rows of any length, their offsets
        size = tensor(name, dtype, shape).get_shape()[0]
        offsets_name = tensor_names.offsets(name)
        offsets = tensor(offsets_name, torch.int64, (), n + 1)
        ends = [int(offsets[0:1]), int(offsets[n : n + 1])]
        if ends != [0, size]:
            raise c.fail(offsets_name, f"first and last offsets [0, {size}] ({what})", ends)

    n = tensor(tensor_names.frame_idx, torch.int64).get_shape()[0]
    for name, leaf in zip(tensor_names.leaves, layout.leaves, strict=True):
        if leaf.ragged:
            blob(name, leaf.dtype, leaf.shape, "the values' rows")
        else:
            tensor(name, leaf.dtype, leaf.shape, n)
    for name in tensor_names.json:
        blob(name, torch.uint8, (), "the blob's length")
    return n


def check_shard(f: Any, c: Check, shard: str, groups: dict, plan: IndexPlan, index: Check) -> None:
    """Check a shard header against the index: its groups, each group's tensors, the rows segments read."""
    got = shard_groups(f, c)
    if got != groups:
        raise c.fail("__metadata__.groups", "the groups the index lists for this shard", got)
    own = (f.metadata() or {}).get("shard")  # written since protocol 2; older shards do not carry it
    if own is not None and own != shard:
        raise c.fail("__metadata__.shard", f"{shard!r} (its own name: shard files were renamed or swapped)", own)
    for g in groups:
        n = check_group(f, c, g, plan.groups[shard, g])
        end, field = plan.needs.get((shard, g), (0, ""))
        if end > n:
            raise index.fail(field, f"start + frames <= {n}, the rows of {g} in {shard}", end)
