"""What a run saved, read back from its files: a complete dataset's index, or a failed run's shards.

Every shard records in its ``__metadata__`` the segments it holds (filename, group, first row,
frames), the run it belongs to and the attempt that wrote it. So what a failed run saved can be
read from its shards alone, even when rank dst was killed before it could list them. Each shard
is checked as `tdgather.open` checks a dataset (header, groups, rows, frame order) before
anything in it is trusted.

- `from_index`: a complete dataset's `RunState`, its index and every shard's header checked.
- `from_shards`: a failed attempt's `RunState`, from its shards' own records (the incomplete
  record adds the failures); copies across writers and attempts resolved.
- `partial_index`: the same as an incomplete index, for ``tdgather.open(path, incomplete=True)``.
- `shard_files`, `loose_shards`, `index_runs`: the shards in a store, those no index lists, and
  the runs the index names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..core.frames import Layout
from ..core.runs import add_runs
from ..errors import DatasetError
from ..format.check import (
    Check,
    check_index,
    check_shard,
    load_json,
    names_in,
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
from .runstate import RunState, new_run
from .segments import open_shard
from .shardrecord import read_record
from .store import Store

__all__ = ["frame_idx_of", "from_index", "from_shards", "index_runs", "loose_shards", "partial_index", "shard_files"]


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


def from_index(store: Store, name: str = INDEX_NAME) -> RunState:
    """A complete dataset's state: its index (``name``: a snapshot's), checked, and every shard's header."""
    c = Check(store.path(name))
    index = load_json(store.read(name), c, "index")
    plan = check_index(index, store.path(name), incomplete=False)
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
        record = read_record(store, name, required)
        if record is None:
            return None
        runs.add(record.run)
        attempt_of[name] = record.attempt
        layout_of.update(((name, g), layout) for g, layout in record.layouts.items())
        for filename, group, start, count in zip(
            record.filenames, record.segment_groups, record.starts, record.frames, strict=True
        ):
            segment = {"shard": name, "group": group, "start": start, "frames": count}
            entry = files.get(filename)
            if entry is None:
                files[filename] = {"frames": count, "segments": [segment]}
            else:
                entry["frames"] += count
                entry["segments"].append(segment)
        shards[name] = {"frames": sum(record.rows.values()), "bytes": record.nbytes, "groups": record.groups}
    if len(runs) > 1:
        raise DatasetError(store.where, "shards", f"expected the shards of one run, got runs {sorted(runs)}")
    order_of = {name: shard_order(name, attempt) for name, attempt in attempt_of.items()}
    frame_idx = frame_idx_of(store, layout_of)
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


def frame_idx_of(store: Store, layout_of: Mapping[tuple[str, str], Layout]) -> Callable[[str, str], torch.Tensor]:
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
        if not all_idx.numel():  # listed with no frame (an index edited by hand, or an old one): nothing saved
            continue
        runs = add_runs(None, all_idx)
        if int((runs[:, 1] - runs[:, 0] + 1).sum()) != all_idx.numel():
            raise DatasetError(store.where, f"files[{name!r}]", "expected each frame once, got a frame in two segments")
        state.written[name] = runs


def shard_files(store: Store) -> list[str]:
    """The shards in ``store``, by name."""
    return sorted(n for n in store.list() if SHARD_NAME.fullmatch(n))
