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
   the job's copy stays in its shard, unlisted, and is counted (``duplicates_dropped``), so each
   frame is in the dataset once, the first committed copy;
4. a job that fails before its commit leaves its shards unlisted: no snapshot names them, so no
   reader sees them. Run it again (a new run): its frames are committed once, by the rerun.
   Nothing removes the unlisted shards yet (each is named by its run: ``tdgather inspect`` and
   a listing tell them apart);
5. snapshots are never replaced or removed here: ``tdgather.open(path, version=n)`` reads snapshot
   n as it was committed.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

import torch

from ..core.frames import Layout
from ..core.promote import SAME_LAYOUT, common_layout, schema
from ..errors import OutputError, ShapeMismatchError
from ..format.check import Check, check_index, load_json
from ..format.names import FORMAT, INDEX_NAME, OURS, SCHEMA_VERSION, snapshot_name
from ..format.records import SnapshotRecord
from .atomic import final_name
from .outdir import describe_names
from .runstate import RunState, new_run
from .scan import frame_idx_of
from .snapshots import snapshot_numbers
from .store import Store

__all__ = ["MAX_TRIES", "AppendOutput", "merge"]

MAX_TRIES = 64  # commits lost to other jobs' before giving up (each retry reads the newest snapshot again)
_JOB_VARS = ("SLURM_ARRAY_JOB_ID", "SLURM_JOB_ID", "JOB_COMPLETION_INDEX", "TORCHELASTIC_RUN_ID")


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
    """

    tag = True
    overwrite = False
    replaces = None

    def __init__(self, store: Store) -> None:
        self.store = store
        self.target: Path | str = Path(store.where) if store.atomic_rename else store.where
        self.run: str | None = None
        self.snapshot: int | None = None

    def open(self, overwrite: bool, resume: bool) -> RunState:
        """Check the dataset holds only tdgather's files; a new run (each job commits its own frames)."""
        if overwrite or resume:
            flag = "overwrite" if overwrite else "resume"
            raise OutputError(
                f"{self.target!r}: append=True adds this job's frames to the dataset as a new snapshot; {flag}=True "
                "does not go with it. A job that failed before its commit left nothing a reader sees: rerun it "
                "with append=True (its frames are then committed once)"
            )
        if not self.store.conditional_put:
            raise OutputError(
                f"{self.target!r}: append=True needs a store whose conditional write is atomic (a local directory, "
                "S3); this one checks, then writes, so two jobs committing at once could lose one's frames"
            )
        if self.store.atomic_rename:
            os.makedirs(self.store.where, exist_ok=True)
        # another job's file being written (a temporary name beside it, locally) is tdgather's too
        foreign = sorted(n for n in self.store.list() if not OURS.fullmatch(final_name(n)))
        if foreign:
            raise OutputError(
                f"output {self.target!r} holds files tdgather did not write ({describe_names(foreign)}); tdgather "
                "never writes beside what it did not write: choose another path, or move those files away"
            )
        self.run = new_run()
        return RunState(self.run)

    def join(self) -> list[str]:
        """Another writer joins the job's run: it writes its own shards, named by the run; none are there yet."""
        return []

    def commit(self, index: Iterable[bytes], shards: Iterable[str]) -> Path | str:
        """Write the next snapshot: the newest one's shards and filenames plus this job's; retry when another wins.

        Raises:
            OutputError: a shard this job wrote is missing, or `MAX_TRIES` commits were lost to
                other jobs; nothing of this job was committed (its shards stay, unlisted).
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
            numbers = snapshot_numbers(self.store)
            number = numbers[-1] if numbers else -1
            base = None if number < 0 else self._read(INDEX_NAME if number == 0 else snapshot_name(number))
            merged, dropped = merge(self.store, base, mine)
            added = mine["metadata"]["total_frames"] - dropped
            record = SnapshotRecord(
                version=number + 1 if number >= 0 else 1,
                parent=number if number >= 0 else None,
                run=self.run or mine["metadata"].get("run", ""),
                made=datetime.now(UTC).isoformat(timespec="milliseconds"),
                host=socket.gethostname(),
                job=_job(),
                added=added,
                duplicates_dropped=dropped,
                user=mine["metadata"].get("user", {}),
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

    def _read(self, name: str) -> dict:
        """A snapshot, checked whole as `tdgather.open` checks an index."""
        c = Check(self.store.path(name))
        index = load_json(self.store.read(name), c, "index")
        check_index(index, self.store.path(name), incomplete=False)
        return index

    def abort(self, record: Iterable[bytes] | None) -> Path | str:
        """Leave the job's shards, unlisted (a rerun commits its frames); no record (jobs would share its name)."""
        return self.target

    def discard(self, shards: Iterable[str]) -> None:
        """Remove the job's shards (``shards``): no snapshot lists them before its commit."""
        for name in shards:
            self.store.remove(name)

    def close(self) -> None:
        """Nothing is held."""


def merge(store: Store, base: dict | None, mine: dict) -> tuple[dict, int]:
    """The index of ``base`` (a snapshot, or None) plus ``mine`` (a job's own index); and the frames dropped.

    A frame of ``mine`` that ``base`` holds (same filename and frame_idx) is left out: its rows are
    cut from ``mine``'s segments (the shard keeps them, unlisted), and its shard's counts say so.
    Only filenames in both are read (their frame indexes, from the shards).
    """
    meta = dict((base or mine)["metadata"])
    own = int(mine["metadata"].get("duplicates_dropped") or 0) if base else 0  # the job's, within its own frames
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
    group_idx = frame_idx_of(store, layout_of)  # each group's frame indexes, read once

    def frame_idx(seg: dict) -> torch.Tensor:
        return group_idx(seg["shard"], seg["group"])[seg["start"] : seg["start"] + seg["frames"]]

    def layout(seg: dict) -> Layout:
        return layout_of[seg["shard"], seg["group"]]

    dropped = 0
    for name, entry in mine["files"].items():
        have = files.get(name)
        if have is None:
            files[name] = entry
            continue
        _check_fits(name, [layout(s) for s in have["segments"]], [layout(s) for s in entry["segments"]])
        held = torch.cat([frame_idx(s) for s in have["segments"]])
        kept = []
        for seg in entry["segments"]:
            dup = torch.isin(frame_idx(seg), held)
            n = int(dup.sum())
            if n == 0:
                kept.append(seg)
                continue
            dropped += n
            shard = mine_shards[seg["shard"]]
            shard["frames"] -= n
            shard["bytes"] -= n * layout(seg).frame_nbytes  # ragged values stay counted (>= is allowed)
            kept += [dict(seg, start=seg["start"] + lo, frames=hi - lo) for lo, hi in _runs(~dup)]
        files[name] = {"frames": have["frames"] + sum(s["frames"] for s in kept), "segments": have["segments"] + kept}
    shards.update((name, entry) for name, entry in mine_shards.items() if entry["frames"] > 0)
    layouts = {layout_of[name, g] for name, entry in shards.items() for g in entry["groups"]}
    for key in ("failure", "replaces", "frames_per_rank"):
        meta.pop(key, None)
    meta.update(
        total_frames=sum(e["frames"] for e in shards.values()),
        total_bytes=sum(e["bytes"] for e in shards.values()),
        num_filenames=len(files),
        duplicates_dropped=int(meta.get("duplicates_dropped") or 0) + own + dropped,
    )
    meta.setdefault("run", mine["metadata"].get("run"))
    out = {"format": FORMAT, "version": SCHEMA_VERSION, "metadata": meta, "shards": shards}
    out["schema"] = [t.to_json() for t in schema(layouts)]
    out["files"] = dict(sorted(files.items()))  # filenames sorted, as every index lists them
    return out, dropped


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


def _runs(keep: torch.Tensor) -> list[tuple[int, int]]:
    """The runs ``[lo, hi)`` of True in ``keep``."""
    out, lo = [], None
    for i, k in enumerate([*keep.tolist(), False]):
        if k and lo is None:
            lo = i
        elif not k and lo is not None:
            out.append((lo, i))
            lo = None
    return out


def _job() -> str | None:
    """The scheduler's id of this job, where one is set (a SLURM array task, a Kubernetes indexed job)."""
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    for var in _JOB_VARS:
        if os.environ.get(var):
            return f"{var}={os.environ[var]}" + (f"_{task}" if task and var == "SLURM_ARRAY_JOB_ID" else "")
    return None
