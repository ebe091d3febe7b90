"""Jobs of the many-jobs acceptance bar (tests/test_append_bar.py): plain processes and 2-rank gloo worlds
that append their share to one dataset, locally or on S3, and may be held at a seam until the test kills them.

A job is held by announcing its mode (a marker file ``<label>.<mode>`` holding its pid, in the
``markers`` directory), then sleeping until the test SIGKILLs it. The seams are public ones: the
`tdgather.storage.sink.SinkFactory` the job passes (``sink=``) makes a `DatasetWriter` over a
store double (`HoldStore`) that wraps the real store (`store_at`), or, locally, over a `LocalStore`
whose `LocalFS` tears the snapshot it writes (`TornFS`). Modes, by when the job dies:

- ``"adding"``: before its commit, halfway through its frames (a `Collector`'s adds), or before its `save`;
- ``"commit"``: in its commit, before the conditional write of its snapshot (it commits nothing);
- ``"torn"``: in its commit, half its snapshot written under the temporary name (local only: nothing committed);
- ``"racing"``: in its commit, the test's kill (a random moment later) racing its conditional write and
  its exit (committed or not, killed or ended: the snapshots say);
- ``"landed"``: in its commit, once its snapshot was written, before the write returned (committed);
- ``"committed"``: after its commit, before the process exits (committed).

Each job also announces its run id (``<label>.run``) as its sink is made, so the test knows which
snapshot each attempt committed. Frame values are `tests.append_cases.value`'s (a ragged ``boxes``
and a ``score``, from the filename and frame index alone), so any kept copy is checkable bit for bit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

import tdgather
from tdgather.format.names import SNAPSHOT_NAME
from tdgather.storage.atomic import LocalFS
from tdgather.storage.location import local_path, store_at
from tdgather.storage.store import LocalStore, Store
from tdgather.storage.writer import DatasetWriter

from . import append_cases
from .append_cases import value

JOBS = 16
HOLD = 300.0  # a held job sleeps this long; the test kills it long before (its timeouts are shorter)
# whether a job killed in each mode has committed (None: either)
COMMITS = {"adding": False, "commit": False, "torn": False, "racing": None, "landed": True, "committed": True}


def share(job: int) -> dict[str, list[int]]:
    """Job ``job``'s 17 frames, each filename shared with a few jobs only (a commit reads the segments it shares).

    Frames 0-5 of its own clip and 4-9 of the next job's (2 in that job's share), and 5 of its group of 4's
    (2 in each neighbour's in the group).
    """
    return {
        f"clip_{job}.mp4": list(range(6)),
        f"clip_{(job + 1) % JOBS}.mp4": list(range(4, 10)),
        f"group_{job // 4}.mp4": list(range(3 * (job % 4), 3 * (job % 4) + 5)),
    }


def frames_of(job: int) -> list[tuple[str, int]]:
    return [(name, idx) for name, idxs in share(job).items() for idx in idxs]


def expected(jobs: range | list[int]) -> dict[str, set[int]]:
    """Every frame the jobs send, once."""
    return append_cases.expected(jobs, share)


def sent(job: int) -> int:
    """The frames one attempt of the job sends."""
    return len(frames_of(job))


# ---------------------------------------------------------------- markers


def announce(markers: str, label: str, what: str, text: str | None = None) -> None:
    """``<markers>/<label>.<what>``, holding ``text`` (default: this pid), put in place whole."""
    where = Path(markers) / f"{label}.{what}"
    tmp = where.with_name(f".{where.name}.tmp")
    tmp.write_text(str(os.getpid()) if text is None else text)
    os.replace(tmp, where)


def hold(markers: str, label: str, mode: str) -> None:
    """Announce ``mode``, then wait to be killed (an error, should the test never kill this process)."""
    announce(markers, label, mode)
    time.sleep(HOLD)
    raise RuntimeError(f"{label}: held at {mode!r} for {HOLD} s and never killed")


# ---------------------------------------------------------------- seams: the job's store and sink


class HoldStore:
    """The real store, but for a snapshot's conditional write (`Store.put_if`): the job's mode announces or holds it."""

    def __init__(self, real: Store, mode: str | None, markers: str, label: str) -> None:
        self.real, self.mode, self.markers, self.label = real, mode, markers, label

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def put_if(self, name: str, data: bytes, expected: str | None) -> bool:
        snapshot = SNAPSHOT_NAME.fullmatch(name) is not None
        if snapshot and self.mode == "commit":
            hold(self.markers, self.label, "commit")
        if snapshot and self.mode == "racing":  # the test kills it a moment later: before, while or after it writes
            announce(self.markers, self.label, "racing")
        ok = self.real.put_if(name, data, expected)
        if snapshot and ok and self.mode == "landed":
            hold(self.markers, self.label, "landed")
        return ok


class TornFS(LocalFS):
    """A local directory's writes, except the snapshot's: half of it written (its temporary file), then held."""

    def __init__(self, markers: str, label: str) -> None:
        self.markers, self.label = markers, label

    def write_all(self, fd: int, chunks: Any) -> None:
        chunks = list(chunks)
        data = bytes(chunks[0]) if len(chunks) == 1 else b""
        if data.startswith(b"{") and b'"snapshot":' in data:
            super().write_all(fd, [data[: len(data) // 2]])
            os.fsync(fd)
            hold(self.markers, self.label, "torn")
        super().write_all(fd, chunks)


def sink_for(markers: str, label: str, mode: str | None) -> Callable[..., DatasetWriter]:
    """The job's `SinkFactory`: a `DatasetWriter` over `HoldStore` (or, torn, a `LocalStore` over `TornFS`)."""

    def make(path: Any, **kw: Any) -> DatasetWriter:
        if mode == "torn":
            store: Any = LocalStore(local_path(path), fs=TornFS(markers, label))
        else:
            store = HoldStore(store_at(path, kw.get("storage_options")), mode, markers, label)
        writer = DatasetWriter(path, store=store, **kw)
        announce(markers, label, "run", writer.run)
        return writer

    return make


# ---------------------------------------------------------------- jobs


def plain_job(
    path: str, job: int, label: str, mode: str | None, markers: str, storage_options: dict | None = None
) -> None:
    """One process, no process group: a `Collector` that appends (even jobs), or one `save` (odd jobs)."""
    sink = sink_for(markers, label, mode)
    frames = frames_of(job)
    if job % 2:
        if mode == "adding":  # killed while it computes: nothing written yet
            hold(markers, label, "adding")
        preds = {name: [(idx, value(name, idx)) for idx in idxs] for name, idxs in share(job).items()}
        tdgather.save(tdgather.gather(preds), path, append=True, sink=sink, storage_options=storage_options)
    else:
        with tdgather.Collector(
            path, append=True, storage_options=storage_options, sink=sink, progress=False, log_summary=False
        ) as col:
            for k, (name, idx) in enumerate(frames):  # one frame a batch, as a slow model's loop adds them
                if mode == "adding" and k == len(frames) // 2:
                    hold(markers, label, "adding")
                col.add([name], [idx], [value(name, idx)])
    if mode == "committed":
        hold(markers, label, "committed")


def world_job(path: str, job: int, label: str, mode: str | None, markers: str, storage_options: dict | None) -> int:
    """A 2-rank gloo world (each rank half the job's frames) appending through rank 0, whose mode it is."""
    rank = dist.get_rank()
    announce(markers, label, f"pid{rank}")  # for the test to kill what is left, should it fail
    mine = mode if rank == 0 else None
    frames = frames_of(job)[rank :: dist.get_world_size()]
    with tdgather.Collector(
        path,
        append=True,
        storage_options=storage_options,
        sink=sink_for(markers, label, mine),
        progress=False,
        log_summary=False,
        timeout=60,
    ) as col:
        for k, (name, idx) in enumerate(frames):
            if mine == "adding" and k == len(frames) // 2:
                hold(markers, label, "adding")
            col.add([name], [idx], [value(name, idx)])
    if mine == "committed":
        hold(markers, label, "committed")
    return rank
