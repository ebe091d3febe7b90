"""Resume: what earlier attempts of a run saved, read back from disk, and what is left to do.

Every shard records in its ``__metadata__`` the segments it holds (filename, group, first row,
frames), the run it belongs to and the attempt that wrote it. So what a failed run saved can be
read from its shards alone, even when rank dst was killed before it could list them. Each shard
is checked as `tdgather.open` checks a dataset (header, groups, rows, frame order) before
anything in it is trusted.

- `load_state` (rank dst, when a Collector opens with ``resume=True``): the run to continue, from
  ``<path>.partial`` (a failed or killed attempt) or from ``<path>`` (a complete one).
- `Saved`: the frames saved, per filename, as every rank sees them. Rank dst sends them in its
  ready answer as JSON (checked on receipt); ``todo`` and ``subset`` skip them.
- `saved`: the same, read from disk where the output is visible.
"""

from __future__ import annotations

import bisect
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.checks import ProtocolCheck, decode_layout
from ..core.duplicates import DuplicateCounts
from ..core.frames import Layout
from ..core.inputs import as_index, index_value
from ..core.runs import add_runs
from ..errors import DatasetError, OutputError
from ..format.check import (
    Check,
    check_group,
    check_index,
    check_layout,
    check_shard,
    load_json,
    names_in,
    shard_groups,
)
from ..format.names import (
    FORMAT,
    INCOMPLETE_NAME,
    INDEX_NAME,
    RAGGED_VERSION,
    RUN_TAG,
    SHARD_NAME,
    shard_order,
    shard_run,
)
from ..format.records import Attempt, Failure
from .combine import resolve
from .location import is_url, local_path, store_at
from .outdir import fsync_dir, staging_of
from .runmark import RunMark
from .segments import open_shard
from .store import LocalStore, Store

__all__ = [
    "RunState",
    "Saved",
    "from_index",
    "from_shards",
    "index_runs",
    "load_state",
    "loose_shards",
    "new_run",
    "partial_index",
    "prefix_state",
    "saved_at",
    "shard_files",
]

_TMP = re.compile(r"\..+\.tmp-\d+")  # a file a killed writer left half-written: never listed anywhere


def new_run() -> str:
    """A new run's id: every shard of the run carries it, and resumed attempts keep it."""
    return uuid.uuid4().hex


@dataclass
class RunState:
    """What earlier attempts saved, as rank dst's writer continues from it.

    Attributes:
        run: the run's id, in every shard's ``__metadata__`` and in the index.
        shards, files: as the index lists them (``shards[name]``: frames, bytes, groups;
            ``files[name]``: frames, segments).
        layouts: each filename's layout.
        written: per filename, the frame_idx saved, as runs (`tdgather.core.runs`).
        attempts: one `Attempt` per earlier attempt: its number, frames saved, how it ended.
        duplicates: copies of a frame in several writers' shards, dropped when read back.
    """

    run: str
    shards: dict[str, dict] = field(default_factory=dict)
    files: dict[str, dict] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    written: dict[str, torch.Tensor] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    duplicates: DuplicateCounts = field(default_factory=DuplicateCounts)  # copies dropped across writers

    @property
    def attempt(self) -> int:
        """The number of the attempt that continues from this state."""
        return max((a.attempt for a in self.attempts), default=0) + 1

    def to_saved(self) -> Saved:
        """What every rank gets: the frames saved, and each filename's layout."""
        return Saved({name: runs.flatten().tolist() for name, runs in self.written.items()}, self.layouts)


class Saved(Mapping[str, torch.Tensor]):
    """The frames a resumed run has saved already: ``saved[filename]`` is their sorted frame_idx.

    Every rank of the Collector gets the same one (``col.saved``), so filtering the same list
    with it gives every rank the same remaining work, and a `DistributedSampler` over what is
    left splits it as it would a fresh list. Empty for a fresh run.

    Example:
        >>> saved = Saved({"a.mp4": [0, 2, 5, 5]})  # frames 0, 1, 2 and 5 of a.mp4
        >>> saved.todo([("a.mp4", 1), ("a.mp4", 3), ("b.mp4", 0)])
        [('a.mp4', 3), ('b.mp4', 0)]
        >>> saved.has("a.mp4", range(3)), saved.has("a.mp4", range(4)), saved.num_frames
        (True, False, 4)
    """

    def __init__(self, runs: Mapping[str, list[int]] | None = None, layouts: Mapping[str, Layout] | None = None):
        self._starts = {name: flat[0::2] for name, flat in (runs or {}).items()}
        self._ends = {name: flat[1::2] for name, flat in (runs or {}).items()}
        self.layouts: dict[str, Layout] = dict(layouts or {})  # the layout each filename was saved with
        self.num_frames = sum(e - s + 1 for name in self._starts for s, e in zip(*self._runs(name), strict=True))

    def _runs(self, name: str) -> tuple[list[int], list[int]]:
        return self._starts[name], self._ends[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        starts, ends = self._runs(name)  # arange(s, e) + [e]: e + 1 may not fit in int64
        return torch.cat(
            [torch.cat([torch.arange(s, e), torch.tensor([e])]) for s, e in zip(starts, ends, strict=True)]
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._starts)

    def __len__(self) -> int:
        return len(self._starts)

    def __repr__(self) -> str:
        return f"Saved({len(self)} filenames, {self.num_frames} frames)"

    def has(self, filename: str, frame_idx: Any) -> bool:
        """Whether every frame given is saved: one index, or several (a range, list, tensor or array).

        A filename alone cannot say it: tdgather does not know how many frames it has. For a
        sample that is a whole video, pass ``range(num_frames)``.
        """
        if isinstance(frame_idx, range | list | tuple) and not frame_idx:
            return True  # no frames: nothing left to do
        if filename not in self._starts:
            return False
        starts, ends = self._runs(filename)
        one = index_value(frame_idx)
        if one is not None:
            at = bisect.bisect_right(starts, one) - 1
            return at >= 0 and one <= ends[at]
        if isinstance(frame_idx, range) and frame_idx.step == 1:
            if not frame_idx:
                return True
            at = bisect.bisect_right(starts, frame_idx.start) - 1
            return at >= 0 and frame_idx.stop - 1 <= ends[at]
        idx = as_index(frame_idx, f"Saved.has({filename!r}) frame_idx").tolist()
        return all(self.has(filename, i) for i in idx)

    def todo(self, items: Iterable[Any], key: Callable[[Any], tuple[str, Any]] | None = None) -> list[Any]:
        """The items whose frames are not all saved, in their order.

        Args:
            items: the work of the whole run, the same list on every rank (before any sampler).
            key: gives an item's ``(filename, frame_idx)``: one frame index, or several (a whole
                video: ``range(n)``). Default: the item is that pair.
        """
        out = []
        for item in items:
            pair = key(item) if key is not None else item
            if isinstance(pair, Mapping):  # a dict would unpack to its keys
                raise TypeError(
                    f"Saved.todo: got a {type(pair).__name__} item and no key; pass "
                    "key=lambda item: (item['filename'], item['frame_idx'])"
                )
            try:
                filename, frame_idx = pair
            except (TypeError, ValueError):
                raise TypeError(
                    f"Saved.todo: expected key(item) to give (filename, frame_idx), got {type(pair).__name__} "
                    f"{pair!r:.60}; pass key=lambda item: (item['filename'], item['frame_idx']) (or a range of "
                    "frame indexes for a whole video)"
                ) from None
            if not isinstance(filename, str):
                raise TypeError(f"Saved.todo: expected a str filename, got {type(filename).__name__} {filename!r:.60}")
            if not self.has(filename, frame_idx):
                out.append(item)
        return out

    def subset(self, dataset: Any, key: Callable[[int], tuple[str, Any]]) -> torch.utils.data.Subset:
        """A `torch.utils.data.Subset` of ``dataset`` without the items saved.

        ``key(i)`` gives item ``i``'s ``(filename, frame_idx)`` without loading it, e.g.
        ``key=lambda i: dataset.samples[i]``.
        """
        return torch.utils.data.Subset(dataset, self.todo(range(len(dataset)), key))

    def to_wire(self) -> dict:
        """The JSON rank dst sends every rank: flat runs per filename, and each filename's layout."""
        layouts = list(dict.fromkeys(self.layouts.values()))
        number = {layout: k for k, layout in enumerate(layouts)}
        return {
            "runs": {name: [v for pair in zip(*self._runs(name), strict=True) for v in pair] for name in self},
            "layouts": [layout.to_json() for layout in layouts],
            "layout_of": {name: number[layout] for name, layout in self.layouts.items()},
        }

    @staticmethod
    def from_wire(obj: Any, src: int) -> Saved:
        """Check and decode what `to_wire` made, received from rank ``src`` (ProtocolError if malformed)."""
        c = ProtocolCheck(src)
        c.obj(obj, "header.saved", {"runs", "layouts", "layout_of"})
        raw = c.list(obj["layouts"], "header.saved.layouts")
        layouts = [decode_layout(x, c, f"header.saved.layouts[{k}]") for k, x in enumerate(raw)]
        runs = {}
        for name, flat in _items(c, obj["runs"], "header.saved.runs"):
            f = f"header.saved.runs[{name[:40]!r}]"
            values = _ints(c, flat, f)
            ordered = all(a <= b for a, b in zip(values, values[1:], strict=False))
            apart = all(values[k] < values[k + 1] for k in range(1, len(values) - 1, 2))
            if len(values) % 2 or not values or not ordered or not apart:
                raise c.fail(f, "[first, last, ...] runs: sorted, disjoint, at least one", values[:8])
            runs[name] = values
        layout_of = {}
        for name, k in _items(c, obj["layout_of"], "header.saved.layout_of"):
            layout_of[name] = layouts[c.int(k, f"header.saved.layout_of[{name[:40]!r}]", len(layouts) - 1)]
        if layout_of.keys() != runs.keys():
            raise c.fail(
                "header.saved.layout_of", "a layout for each filename in header.saved.runs", sorted(layout_of)[:5]
            )
        return Saved(runs, layout_of)


def _items(c: ProtocolCheck, obj: Any, field: str) -> list[tuple[str, Any]]:
    if not isinstance(obj, dict):
        raise c.fail(field, "an object", type(obj).__name__)
    return [(c.str(k, f"{field} key"), v) for k, v in obj.items()]


def _ints(c: ProtocolCheck, obj: Any, field: str) -> list[int]:
    values = c.list(obj, field)
    bad = [v for v in values if type(v) is not int or not -(2**63) <= v < 2**63]
    if bad:
        raise c.fail(field, "int64 integers", bad[:3])
    return values


def saved_at(path: str | os.PathLike, storage_options: dict | None = None) -> Saved:
    """What a Collector with ``resume=True`` would find saved at ``path`` (read on this machine).

    Use it where rank dst's output is visible (one machine, a shared filesystem, an object store),
    for example to build Lightning's predict dataloader; ``col.saved`` is the same on every rank.
    """
    if is_url(path):
        state = prefix_state(store_at(path, storage_options))
        return state.to_saved() if state is not None else Saved()
    target = local_path(path)
    state = _read(target, staging_of(target), overwrite=True)
    return state.to_saved() if state is not None else Saved()


def index_runs(store: Store) -> tuple[set[str], str | None, str | None]:
    """The complete dataset's shard names, its run and the run it replaced (nothing when there is no index)."""
    if store.size(INDEX_NAME) is None:
        return set(), None, None
    c = Check(store.path(INDEX_NAME))
    index = c.mapping(load_json(store.read(INDEX_NAME), c, "index"), "index")
    meta = c.mapping(index.get("metadata"), "metadata")
    run, replaces = meta.get("run"), meta.get("replaces")
    return (
        set(c.mapping(index.get("shards"), "shards")),
        run if isinstance(run, str) else None,
        replaces if isinstance(replaces, str) else None,
    )


def loose_shards(store: Store, listing: Iterable[str] | None = None) -> list[str]:
    """The shards no index lists: a failed (or running) run's; not those a replaced dataset left behind."""
    names = sorted(n for n in (store.list() if listing is None else listing) if SHARD_NAME.fullmatch(n))
    listed, _, replaces = index_runs(store)
    left_behind = replaces[:RUN_TAG] if replaces else None
    return [n for n in names if n not in listed and shard_run(n) != left_behind]


def prefix_state(store: Store) -> RunState | None:
    """What a run resumed at this prefix continues from: a failed run's shards, else the complete dataset."""
    loose = loose_shards(store)
    if loose:
        return from_shards(store, loose)
    return from_index(store) if store.size(INDEX_NAME) is not None else None


def partial_index(store: Store, names: list[str] | None = None) -> dict | None:
    """What a failed run saved in ``store`` (its shards ``names``; default all), as an incomplete index.

    Built from the shards' own records: the truth also after rank dst was killed (no
    ``tdgather.incomplete.json``), or after a resumed attempt failed. None when there are no
    shards, or shards of a tdgather that kept no record.
    """
    names = shard_files(store) if names is None else names
    state = from_shards(store, names, required=False) if names else None
    if state is None:
        return None
    last = state.attempts[-1]
    record = _record(store, state.run)  # its other keys (frames per rank, duplicates, yours), if the last attempt's
    recorded_last = max(
        (a.attempt for a in _attempts(record, Check(store.path(INCOMPLETE_NAME)), "metadata")), default=0
    )
    meta = {
        **(record if recorded_last == last.attempt else {}),
        "run": state.run,
        "attempts": [a.to_json() for a in state.attempts],
        "failure": (last.failure or _UNRECORDED).to_json(),
    }
    return _shards_index(state.shards, dict(sorted(state.files.items())), meta)  # as from_shards checked it


def load_state(target: Path, staging: Path, overwrite: bool) -> RunState | None:
    """The state to continue from, with ``staging`` ready to write into; None when nothing is saved.

    Sources, in order: a complete dataset in ``staging`` (its move into place was interrupted), the
    shards a failed or killed attempt left there, or a complete dataset at ``target`` (whose shards
    are then linked into ``staging``, and which the new one replaces when complete).

    Raises:
        OutputError: both hold a complete dataset, or a failed attempt would replace a complete
            dataset without ``overwrite``.
        DatasetError: a shard or record is malformed; nothing is changed.
    """
    state = _read(target, staging, overwrite)
    if state is None:
        return None
    if not staging.is_dir():
        staging.mkdir()
    linked = [n for n in state.shards if not (staging / n).exists()]
    for name in linked:  # resuming a complete dataset (beside an empty staging directory too): from its shards
        _link(target / name, staging / name)
    if linked:
        fsync_dir(staging)
    for name in os.listdir(staging):  # what a killed writer left half-written
        if _TMP.fullmatch(name) and (staging / name).is_file():
            (staging / name).unlink()
    return state


def _read(target: Path, staging: Path, overwrite: bool) -> RunState | None:
    complete_target = (target / INDEX_NAME).is_file()
    if (staging / INDEX_NAME).is_file():
        if complete_target:
            raise OutputError(
                f"both {str(target)!r} and {str(staging)!r} hold a complete dataset (a move into place was "
                "interrupted): keep the one you want, remove the other, and resume again"
            )
        return from_index(LocalStore(staging))
    shards = shard_files(LocalStore(staging))
    if shards:
        if complete_target and not overwrite:
            raise OutputError(
                f"{str(staging)!r} holds what a failed run saved, and {str(target)!r} a complete dataset, which "
                "finishing that run would replace: pass overwrite=True as well as resume=True to do so, or move "
                "one of them away"
            )
        return from_shards(LocalStore(staging), shards)
    mark = RunMark.read(LocalStore(staging))
    if mark is not None and (mark.overwrite or not complete_target):  # a run killed before its first shard:
        return RunState(mark.run)  # continue it (a new attempt), not the dataset it was replacing
    if complete_target:
        return from_index(LocalStore(target))
    return None


def from_index(store: Store) -> RunState:
    """A complete dataset's state: its index, checked, and every shard's header."""
    c = Check(store.path(INDEX_NAME))
    index = load_json(store.read(INDEX_NAME), c, "index")
    plan = check_index(index, store.path(INDEX_NAME), incomplete=False)
    for name, entry in index["shards"].items():  # every shard's header, as Dataset.verify() checks it
        with open_shard(store, name, c, f"shards[{name!r}]") as f:
            check_shard(f, Check(store.path(name)), name, entry["groups"], plan, c)
    meta = index["metadata"]
    attempts = _attempts(meta, c, "metadata")
    run = meta.get("run") if isinstance(meta.get("run"), str) else new_run()  # older datasets have none
    state = RunState(run, index["shards"], index["files"], plan.layouts, attempts=attempts)
    if not attempts:
        state.attempts = [Attempt(1, sum(s["frames"] for s in state.shards.values()))]
    _read_frames(store, state)
    return state


def from_shards(
    store: Store,
    names: list[str],
    required: bool = True,
    policy: Any = "keep",
    frames: bool = True,
    fixed: bool = False,
) -> RunState | None:
    """A failed attempt's state, from its shards' own records (the incomplete record adds failures).

    Copies of one frame in shards of several writers or attempts are resolved by ``policy``
    (`tdgather.storage.combine.resolve`); with ``frames`` False, ``written`` is left empty. A shard of an
    older tdgather, which keeps no record, raises `DatasetError`; unless ``required`` is False:
    then this returns None. A filename's segments may be in groups whose layouts fit (a leaf's first
    dim differs: `tdgather.core.promote.common_layout`); not with ``fixed``.
    """
    shards: dict[str, dict] = {}
    files: dict[str, dict] = {}
    attempt_of: dict[str, int] = {}
    layout_of: dict[tuple[str, str], Layout] = {}
    runs = set()
    for name in names:
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
                raise c.fail(
                    "__metadata__.shard", f"{name!r} (its own name: shard files were renamed)", meta.get("shard")
                )
            runs.add(c.str(meta.get("run"), "__metadata__.run"))
            attempt = meta.get("attempt", "")
            if not (attempt.isdigit() and 0 < int(attempt) < 1 << 31):
                raise c.fail("__metadata__.attempt", "a positive integer", attempt)
            attempt_of[name] = int(attempt)
            raw = shard_groups(f, c)
            groups = {g: check_layout(desc, c, f"__metadata__.groups[{g!r}]") for g, desc in raw.items()}
            layout_of.update(((name, g), layout) for g, layout in groups.items())
            rows = {g: check_group(f, c, g, layout) for g, layout in groups.items()}
            covered = dict.fromkeys(groups, 0)
            segments = c.list(load_json(c.str(record, "__metadata__.segments"), c, "__metadata__.segments"), "segments")
            for i, seg in enumerate(segments):
                sf = f"__metadata__.segments[{i}]"
                filename, group, start, count = c.list(seg, sf, 4)
                c.str(filename, f"{sf}[0]"), c.int(start, f"{sf}[2]"), c.int(count, f"{sf}[3]")
                if group not in groups or start != covered[group]:
                    raise c.fail(sf, f"the next rows of a group of this shard ({sorted(groups)})", seg)
                covered[group] += count
                entry = files.setdefault(filename, {"frames": 0, "segments": []})
                entry["frames"] += count
                entry["segments"].append({"shard": name, "group": group, "start": start, "frames": count})
            if covered != rows:
                raise c.fail("__metadata__.segments", f"segments that cover every row ({rows})", covered)
            nbytes = 0
            for g, layout in groups.items():
                names_g = names_in(f, c, g, layout)
                nbytes += rows[g] * layout.frame_nbytes
                for leaf, tensor in zip(layout.leaves, names_g.leaves, strict=True):
                    if leaf.ragged:
                        nbytes += f.get_slice(tensor).get_shape()[0] * leaf.row_nbytes
            shards[name] = {"frames": sum(rows.values()), "bytes": nbytes, "groups": raw}
    if len(runs) > 1:
        raise DatasetError(store.where, "shards", f"expected the shards of one run, got runs {sorted(runs)}")
    order_of = {name: shard_order(name, attempt) for name, attempt in attempt_of.items()}
    frame_idx = _frame_idx_of(store, layout_of)
    duplicates, dropped = resolve(store, files, layout_of, order_of, frame_idx, policy, fixed)
    for name, (count, nbytes) in dropped.items():  # a dropped copy stays in its shard, listed by no segment
        shards[name]["frames"] -= count
        shards[name]["bytes"] -= nbytes
    frames_of: dict[int, int] = {}
    for name, shard in shards.items():
        frames_of[attempt_of[name]] = frames_of.get(attempt_of[name], 0) + shard["frames"]
    plan = check_index(_shards_index(shards, files), store.where, incomplete=False)  # counts, overlaps, joins
    run = runs.pop()
    recorded = _recorded_attempts(store, run)
    attempts = []
    for k in sorted({*frames_of, *recorded}):
        failure = recorded[k].failure if k in recorded else _UNRECORDED
        attempts.append(Attempt(k, frames_of.get(k, 0), failure))
    state = RunState(run, shards, files, plan.layouts, attempts=attempts, duplicates=duplicates)
    if frames:
        _read_frames(store, state)
    return state


def _shards_index(shards: dict[str, dict], files: dict[str, dict], metadata: dict | None = None) -> dict:
    """The index of what shards' own records list, as `from_shards` checks it and `partial_index` gives it.

    Its version is the rules of every index this tdgather writes (`RAGGED_VERSION`: a filename's
    segments may differ in a leaf's first dim), whatever the shard entries list: they carry no
    ``size`` (``index_version`` would say 3 or 4, whose rules refuse what this tdgather writes).
    """
    totals = {
        "total_frames": sum(s["frames"] for s in shards.values()),
        "total_bytes": sum(s["bytes"] for s in shards.values()),
        "num_filenames": len(files),
    }
    return {
        "format": FORMAT,
        "version": RAGGED_VERSION,
        "metadata": {**(metadata or {}), **totals},
        "shards": shards,
        "files": files,
    }


def _frame_idx_of(store: Store, layout_of: Mapping[tuple[str, str], Layout]) -> Callable[[str, str], torch.Tensor]:
    """``frame_idx(shard, group)``: the group's frame indexes, read once."""
    cache: dict[tuple[str, str], torch.Tensor] = {}

    def frame_idx(shard: str, group: str) -> torch.Tensor:
        if (shard, group) not in cache:
            c = Check(store.path(shard))
            with open_shard(store, shard, Check(store.where), "shard") as f:
                cache[shard, group] = f.get_tensor(names_in(f, c, group, layout_of[shard, group]).frame_idx)
        return cache[shard, group]

    return frame_idx


_UNRECORDED = Failure(
    "Unrecorded", "this attempt recorded no failure: rank dst stopped (killed?) before it could", None
)


def _record(store: Store, run: str | None = None) -> dict:
    """The metadata the last failed attempt recorded (``tdgather.incomplete.json``), or {}.

    With ``run``, a record of another run (left beside a dataset in an object store) counts as none.
    """
    if store.size(INCOMPLETE_NAME) is None:
        return {}
    c = Check(store.path(INCOMPLETE_NAME))
    meta = c.mapping(c.mapping(load_json(store.read(INCOMPLETE_NAME), c, "index"), "index").get("metadata"), "metadata")
    if "failure" in meta:
        Failure.from_json(meta["failure"], c, "metadata.failure")
    if run is not None and meta.get("run", run) != run:
        return {}
    return meta


def _recorded_attempts(store: Store, run: str | None = None) -> dict[int, Attempt]:
    """The attempts the last failed attempt (of ``run``) recorded, by number."""
    return {a.attempt: a for a in _attempts(_record(store, run), Check(store.path(INCOMPLETE_NAME)), "metadata")}


def _attempts(meta: dict, c: Check, field: str) -> list[Attempt]:
    """The ``attempts`` a complete or incomplete index records, each checked as an `Attempt` (absent: none)."""
    listed = c.list(meta.get("attempts", []), f"{field}.attempts")
    return [Attempt.from_json(a, c, f"{field}.attempts[{i}]") for i, a in enumerate(listed)]


def _read_frames(store: Store, state: RunState) -> None:
    """Fill ``state.written`` from each segment's frame_idx (each shard opened once), checking their order."""
    by_shard: dict[str, list[tuple[str, dict]]] = {}
    for name, entry in state.files.items():
        for seg in entry["segments"]:
            by_shard.setdefault(seg["shard"], []).append((name, seg))
    pieces: dict[str, list[torch.Tensor]] = {}
    for shard, segments in by_shard.items():
        c = Check(store.path(shard))
        with open_shard(store, shard, Check(store.where), "shard") as f:
            idx_of = {}
            for name, seg in segments:
                g = seg["group"]
                if g not in idx_of:
                    idx_of[g] = f.get_tensor(names_in(f, c, g, state.layouts[name]).frame_idx)
                idx = idx_of[g][seg["start"] : seg["start"] + seg["frames"]]
                if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
                    raise c.fail(
                        f"{g}:frame_idx", f"strictly increasing indices in the rows of {name!r}", idx[:8].tolist()
                    )
                pieces.setdefault(name, []).append(idx)
    for name, idx in pieces.items():
        all_idx = torch.cat(idx)
        runs = add_runs(None, all_idx)
        if int((runs[:, 1] - runs[:, 0] + 1).sum()) != all_idx.numel():
            raise DatasetError(store.where, f"files[{name!r}]", "expected each frame once, got a frame in two segments")
        state.written[name] = runs


def shard_files(store: Store) -> list[str]:
    """The shards in ``store``, by name."""
    return sorted(n for n in store.list() if SHARD_NAME.fullmatch(n))


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a second name of ``src`` (a copy where the filesystem has no hard links)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as fh:
            os.fsync(fh.fileno())
