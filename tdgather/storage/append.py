"""`AppendOutput`: many independent jobs append to one dataset, each frame exactly once.

Rules (the `tdgather.storage.output.Output` of ``append=True``, on any store whose `Store.put_if`
is atomic: a local directory, by a hard link that fails where the name exists; S3, by ``If-None-Match``):

1. every job writes its shards under names of its own run and attempt (`shard_name`'s tag), beside
   the others'; it never writes over, or removes, what another job wrote;
2. a job commits by writing the next snapshot, ``tdgather.snapshot-<n+1>.json``, only if absent
   (`Store.put_if` with no version): the newest snapshot's shards and filenames, plus its own.
   Of two jobs that commit at once one wins; the other reads the new newest snapshot and tries
   again, without uploading anything again (`MAX_TRIES` times);
3. a frame, (filename, frame_idx), that the newest snapshot already holds is not listed again:
   the job's copy is compared with the held one and resolved by the job's duplicates policy, as
   copies within a run are (`merge`): counted (``duplicates_dropped``, exact or inexact) and left
   in its shard, unlisted, so each frame is in the dataset once, the first committed copy; or
   refused (`DuplicateFrameError`, nothing of the job committed);
4. a job that fails before its commit leaves its shards unlisted: no snapshot names them, so no
   reader sees them. Run it again (a new run): its frames are committed once, by the rerun.
   `tdgather.storage.expire` removes unlisted shards where asked (``orphans=True``);
5. snapshots are never replaced or removed here: ``tdgather.open(path, version=n)`` reads snapshot
   n as it was committed, until `tdgather.storage.expire` removes it (`tdgather.storage.compact`
   rewrites the newest into fewer shards, as the next snapshot).
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..core.duplicates import DuplicateCounts, DuplicatePolicy
from ..core.frames import Layout
from ..core.promote import SAME_LAYOUT, common_layout, schema
from ..errors import DatasetError, OutputError, ShapeMismatchError
from ..format.blocks import counts_of
from ..format.names import FORMAT, OURS, RUN_TAG, SCHEMA_VERSION, shard_run, snapshot_name
from ..format.records import SnapshotRecord
from .atomic import final_name
from .combine import resolve
from .jobmark import JOB_VAR, continue_job, job_key
from .outdir import describe_names
from .runstate import RunState, new_run
from .scan import frame_idx_of
from .snapshots import read_snapshot, snapshot_numbers
from .store import Store

__all__ = ["MAX_TRIES", "AppendOutput", "merge", "totals"]

MAX_TRIES = 64  # commits lost to other jobs' before giving up (each retry reads the newest snapshot again)


class AppendOutput:
    """A dataset that independent jobs append to: each commit a new snapshot (the module's rules).

    Attributes:
        target: the dataset's path or URL.
        store: where the job's shards are put: the dataset itself (names carry the run).
        tag: shard names carry their run and attempt.
        overwrite: always False (appending never replaces).
        replaces: None.
        run: this job's run id, once open.
        snapshot: the snapshot this job committed, once committed.
        policy: the duplicates policy for this job's copies of frames the dataset already holds
            (`merge`); `tdgather.storage.writer.DatasetWriter` gives it its own (the job's ``duplicates=``).
    """

    tag = True
    overwrite = False
    replaces = None
    compacts: int | None = None  # the snapshot a compaction rewrites (`tdgather.storage.compact`); None: a job's frames
    policy: DuplicatePolicy = DuplicatePolicy()  # "keep": the first committed copy stays, later ones are counted

    def __init__(self, store: Store) -> None:
        self.store = store
        self.target: Path | str = Path(store.where) if store.atomic_rename else store.where
        self.run: str | None = None
        self.snapshot: int | None = None

    def open(self, overwrite: bool, resume: bool) -> RunState:
        """Check the dataset holds only tdgather's files; a new run, or (``resume``) this job's earlier one continued.

        With ``resume``, the job is found by its key (`tdgather.storage.jobmark`): the shards its
        earlier attempts wrote are what it saved, and this attempt is claimed before any shard.
        """
        if overwrite:
            raise OutputError(
                f"{str(self.target)!r}: append=True adds this job's frames to the dataset as a new snapshot; "
                "overwrite=True does not go with it (a dataset that jobs append to is never replaced)"
            )
        key = job_key() if resume else None
        if resume and key is None:
            raise OutputError(
                f"{str(self.target)!r}: resume=True with append=True continues this job's earlier attempt, found by a "
                f"key that stays the same when the job runs again, and none is set: set {JOB_VAR}=<a name for this "
                "job's share> (SLURM and a Kubernetes indexed job set one of their own)"
            )
        if not self.store.conditional_put:
            raise OutputError(
                f"{self.target!r}: append=True needs a store whose conditional write is atomic (a local directory, "
                "S3); this one checks, then writes, so two jobs committing at once could lose one's frames"
            )
        if self.store.atomic_rename:
            if os.path.exists(self.store.where) and not os.path.isdir(self.store.where):
                raise OutputError(
                    f"{str(self.target)!r} is a file, not a dataset directory: append=True adds to a directory "
                    "(created if absent): choose another path"
                )
            os.makedirs(self.store.where, exist_ok=True)
        # another job's file being written (a temporary name beside it, locally) is tdgather's too
        listing = self.store.list()
        foreign = sorted(n for n in listing if not OURS.fullmatch(final_name(n)))
        if foreign:
            raise OutputError(
                f"output {self.target!r} holds files tdgather did not write ({describe_names(foreign)}); tdgather "
                "never writes beside what it did not write: choose another path, or move those files away"
            )
        state = continue_job(self.store, key, listing) if key is not None else RunState(new_run())
        self.run = state.run
        return state

    def join(self) -> list[str]:
        """Another writer joins the job's run: it writes its own shards, named by the run; none are there yet."""
        return []

    def commit(self, index: Iterable[bytes], shards: Iterable[str]) -> Path | str:
        """Write the next snapshot: the newest one's shards and filenames plus this job's; retry when another wins.

        Raises:
            OutputError: a shard this job wrote is missing, or `MAX_TRIES` commits were lost to
                other jobs; nothing of this job was committed (its shards stay, unlisted).
            DuplicateFrameError: a frame the dataset holds, sent again with values ``policy`` refuses
                (`merge`); nothing of this job was committed.
        """
        mine = json.loads(b"".join(index))
        listing = self.store.list()
        missing = sorted(set(shards) - set(listing))
        if missing:
            raise OutputError(
                f"{self.target!r}: this job's shards {describe_names(missing)} are not there (removed by hand?); "
                "nothing was committed: rerun the job"
            )
        for attempt in range(MAX_TRIES):
            numbers = snapshot_numbers(self.store, listing if attempt == 0 else None)
            number = numbers[-1] if numbers else -1
            try:
                base = None if number < 0 else read_snapshot(self.store, number)
                merged, added, dropped = self.next_index(number, base, mine)
            except (DatasetError, FileNotFoundError):
                if (snapshot_numbers(self.store) or [-1])[-1] == number:
                    raise  # the newest snapshot, a shard it lists, or this job's own, is damaged
                continue  # superseded and expired while this try read it (`tdgather.storage.expire`): the newest
            record = SnapshotRecord(
                version=number + 1 if number >= 0 else 1,
                parent=number if number >= 0 else None,
                run=self.run or mine["metadata"].get("run", ""),
                made=datetime.now(UTC).isoformat(timespec="milliseconds"),
                host=socket.gethostname(),
                job=job_key(),
                added=added,
                duplicates_dropped=dropped,
                user=mine["metadata"].get("user", {}),
                compacted=self.compacts,
            )
            merged["snapshot"] = record.to_json()
            data = json.dumps(merged, ensure_ascii=False, allow_nan=False).encode()
            if self.store.put_if(snapshot_name(record.version), data, None):
                self.snapshot = record.version
                return self.target
            time.sleep(random.uniform(0, min(1.0, 0.01 * 2**attempt)))  # another job committed: read the newest
        raise OutputError(
            f"{self.target!r}: {MAX_TRIES} commits of run {self.run} were lost to other jobs committing at the same "
            "time; nothing of this job was committed (its shards stay, unlisted): rerun it"
        )

    def next_index(self, number: int, base: dict | None, mine: dict) -> tuple[dict, int, int]:
        """The next snapshot's index, made from snapshot ``number`` (``base``; None: there is none) and this job's.

        Returns it, the frames it adds, and the frames of this job it drops (the newest snapshot holds them).
        """
        merged, dropped = merge(self.store, base, mine, self.policy)
        return merged, merged["metadata"]["total_frames"] - (base["metadata"]["total_frames"] if base else 0), dropped

    def abort(self, record: Iterable[bytes] | None) -> Path | str:
        """Leave the job's shards, unlisted (a rerun commits its frames); no record (jobs would share its name)."""
        return self.target

    def discard(self, shards: Iterable[str]) -> None:
        """Remove the job's shards (``shards``): no snapshot lists them before its commit."""
        for name in shards:
            self.store.remove(name)

    def close(self) -> None:
        """Nothing is held."""


def merge(store: Store, base: dict | None, mine: dict, policy: Any = "keep") -> tuple[dict, int]:
    """The index of ``base`` (a snapshot, or None) plus ``mine`` (a job's own index); and the frames dropped.

    A frame of ``mine`` that ``base`` holds (same filename and frame_idx) is a copy, resolved by the
    job's duplicates ``policy`` as copies within one run are (`tdgather.storage.combine.resolve`):
    ``base``'s copy stays; ``mine``'s is compared with it and counted (exact or inexact, the largest
    difference), then left out (its rows are cut from ``mine``'s segments; the shard keeps them,
    unlisted, and its counts say so), or refused. Only filenames in both are read: their frame
    indexes, and the rows of the frames in both. ``metadata["duplicates"]`` and
    ``metadata["duplicates_dropped"]`` add ``base``'s, ``mine``'s own and those dropped here.

    Raises:
        DuplicateFrameError: a copy ``policy`` refuses, naming the filename, the frame_idx, this job
            and the run that committed the copy ``base`` holds; nothing is committed.
        ShapeMismatchError: frames of a filename whose layout does not fit the dataset's (`_check_fits`).
    """
    if base is not None and set(mine["shards"]) & set(base["shards"]):
        mine = _unlisted(mine, set(base["shards"]))  # a resumed job's shards that an earlier attempt committed
    meta = dict((base or mine)["metadata"])
    # the job's own copies (dropped within its frames), counted once: the first commit's metadata is the job's
    own = _counts(mine["metadata"]) if base else DuplicateCounts()
    own_dropped = int(mine["metadata"].get("duplicates_dropped") or 0) if base else 0
    base = base or {"shards": {}, "files": {}}
    shards = {name: dict(entry) for name, entry in base["shards"].items()}
    mine_shards = {name: dict(entry) for name, entry in mine["shards"].items()}
    files = dict(base["files"])
    layout_of = {
        (shard, g): Layout.from_json(desc)
        for shards_of in (base["shards"], mine["shards"])
        for shard, entry in shards_of.items()
        for g, desc in entry["groups"].items()
    }
    both = {}  # the filenames that base and mine both hold: their segments, base's first
    for name, entry in mine["files"].items():
        have = files.get(name)
        if have is None:
            files[name] = entry
            continue
        layouts = [[layout_of[s["shard"], s["group"]] for s in e["segments"]] for e in (have, entry)]
        _check_fits(name, *layouts)
        both[name] = {"frames": have["frames"] + entry["frames"], "segments": have["segments"] + entry["segments"]}
    copies = _resolve_held(store, both, layout_of, base["shards"], mine_shards, policy, _this_job(mine))
    for name, entry in both.items():  # base's segments as they were, then mine's that are left
        segments = files[name]["segments"] + [s for s in entry["segments"] if s["shard"] in mine_shards]
        files[name] = {"frames": sum(s["frames"] for s in segments), "segments": segments}
    shards.update((name, entry) for name, entry in mine_shards.items() if entry["frames"] > 0)
    layouts = {layout_of[name, g] for name, entry in shards.items() for g in entry["groups"]}
    for key in ("failure", "replaces", "frames_per_rank"):
        meta.pop(key, None)
    meta.update(
        totals(shards, files),
        duplicates_dropped=int(meta.get("duplicates_dropped") or 0) + own_dropped + copies.dropped,
        duplicates=(_counts(meta) + own + copies).to_json(),
    )
    meta.setdefault("run", mine["metadata"].get("run"))
    out = {"format": FORMAT, "version": SCHEMA_VERSION, "metadata": meta, "shards": shards}
    out["schema"] = [t.to_json() for t in schema(layouts)]
    out["files"] = dict(sorted(files.items()))  # filenames sorted, as every index lists them
    return out, copies.dropped


def totals(shards: dict[str, dict], files: dict[str, dict]) -> dict[str, int]:
    """An index's ``total_frames``, ``total_bytes`` and ``num_filenames``, from its shards and files."""
    return {
        "total_frames": sum(e["frames"] for e in shards.values()),
        "total_bytes": sum(e["bytes"] for e in shards.values()),
        "num_filenames": len(files),
    }


def _resolve_held(
    store: Store,
    both: dict[str, dict],
    layout_of: dict[tuple[str, str], Layout],
    held_shards: dict[str, dict],
    mine_shards: dict[str, dict],
    policy: Any,
    this: str,
) -> DuplicateCounts:
    """Resolve the copies in ``both`` (filenames the dataset and this job hold) by ``policy``, as within a run.

    The dataset's copy (in ``held_shards``) is first by precedence, so it stays; this job's copy
    (in ``mine_shards``) is compared with it, counted and cut from ``both``'s segments, its shard's
    frames and bytes less those cut (`tdgather.storage.combine.resolve`); or refused. Each side is
    one source, which never holds a frame twice. Returns the copies dropped, counted.
    """
    order_of = {name: (0, 0, k) for k, name in enumerate(held_shards)}
    order_of.update((name, (1, 0, k)) for k, name in enumerate(mine_shards))
    frame_idx = frame_idx_of(store, layout_of)  # each group's frame indexes, read once
    source = _source(held_shards, this)
    counts, cut = resolve(store, both, layout_of, order_of, frame_idx, policy, source=source, fix=_fix(store.where))
    for name, (frames, nbytes) in cut.items():
        mine_shards[name]["frames"] -= frames
        mine_shards[name]["bytes"] -= nbytes
    return counts


def _source(held_shards: dict[str, dict], this: str) -> Callable[[str], str]:
    """``source(shard)``: who sent a shard's copy, for a refusal: this job, or the run that committed the held one.

    The held copy's run is the one its shard's name carries (`tdgather.format.names.shard_run`);
    an untagged shard is the dataset written before any job appended (snapshot 0).
    """

    def source(shard: str) -> str:
        if shard not in held_shards:
            return f"this job ({this}; shard {shard})"
        run = shard_run(shard)
        if not run:
            return f"the dataset written before any job appended (snapshot 0; shard {shard})"
        return f"the job of run {run} (its commit holds the dataset's copy; shard {shard})"

    return source


def _this_job(mine: dict) -> str:
    """This job, as a refusal names it: its run, and its key (`tdgather.storage.jobmark.job_key`) where one is set.

    The run is its first `RUN_TAG` hex digits, as the job's shards' names and ``tdgather snapshots`` show it.
    """
    run = str(mine["metadata"].get("run") or "")[:RUN_TAG]
    job = job_key()
    return f"run {run}, {job}" if job else f"run {run}"


def _fix(where: str) -> str:
    """What a job whose copy is refused can do, for the refusal's message."""
    return (
        f"`tdgather snapshots {where}` lists each snapshot with the run and the scheduler job that committed it. "
        "Nothing of this job was committed: no snapshot lists its shards, and the dataset is as it was. To keep the "
        "copy the dataset holds and count this job's, append with duplicates='keep' (the default; or a wider "
        "tolerance); to send only what the dataset lacks, leave those frames out: tdgather.saved_at(path).todo(items) "
        "keeps the items no snapshot holds"
    )


def _unlisted(mine: dict, listed: set[str]) -> dict:
    """``mine`` without the shards ``listed`` (and their segments): those are in the dataset already, as they are."""
    shards = {name: entry for name, entry in mine["shards"].items() if name not in listed}
    files = {}
    for name, entry in mine["files"].items():
        segments = [seg for seg in entry["segments"] if seg["shard"] not in listed]
        if segments:
            files[name] = {"frames": sum(seg["frames"] for seg in segments), "segments": segments}
    meta = dict(mine["metadata"], total_frames=sum(e["frames"] for e in shards.values()))
    return {**mine, "metadata": meta, "shards": shards, "files": files}


def _counts(meta: dict) -> DuplicateCounts:
    """An index's ``metadata["duplicates"]`` as counts; none where it is absent (frames saved with no counts).

    Raises:
        DatasetError: counts that are not `DuplicateCounts.to_json`'s (a snapshot edited by hand).
    """
    counts = meta.get("duplicates")
    if counts is None:
        return DuplicateCounts()
    try:
        got = counts_of(counts)
        if type(got.exact) is not int or type(got.inexact) is not int or min(got.exact, got.inexact) < 0:
            raise TypeError("counts that are not ints >= 0")
        return got
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetError(
            "the newest snapshot",
            "metadata.duplicates",
            f"expected {{exact, inexact, max_abs_diff}} as tdgather writes them, got {counts!r:.120} ({e})",
        ) from e


def _check_fits(name: str, held: list[Layout], new: list[Layout]) -> None:
    """Refuse frames of ``name`` whose layout does not fit the dataset's (another dtype, key or dim than the first).

    Raises:
        ShapeMismatchError: naming the filename and both layouts; nothing is committed.
    """
    first = held[0]
    for layout in [*held[1:], *new]:
        joined = common_layout(first, layout)
        if joined is None:
            raise ShapeMismatchError(
                f"filename {name!r}: the dataset holds its frames as {held[0].describe()}, this job's are "
                f"{new[0].describe()}; {SAME_LAYOUT}. Nothing of this job was committed (its shards stay, unlisted): "
                "give its frames the layout the dataset has, or append them under other filenames or to another dataset"
            )
        first = joined
