"""Per-rank cases for resume (tests/test_resume.py): a shuffled, padded sampler over (filename, frame_idx)
samples, a model run in batches, a Collector with ``resume=``; a rank (or rank dst) may SIGKILL itself.

The model is elementwise, so a frame's value does not depend on the batch it was computed in:
an interrupted and resumed run must give the uninterrupted run's dataset bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import tdgather
from tdgather.format.names import SHARD_NAME
from tdgather.storage.atomic import LocalFS
from tdgather.storage.objects import ObjectStore
from tdgather.storage.writer import DatasetWriter

from .faults import _wait_until

SIDE = 24  # frames are [3, SIDE, SIDE]: about 7 KB each


def samples() -> list[tuple[str, int]]:
    """The whole run's work: 6 videos of 7 to 22 frames (87 frames)."""
    return [(f"video_{v}.mp4", i) for v in range(6) for i in range(7 + 3 * v)]


def frame_input(name: str, i: int) -> torch.Tensor:
    v = int(name.removeprefix("video_").removesuffix(".mp4"))
    return torch.rand(3, SIDE, SIDE, generator=torch.Generator().manual_seed(1000 * v + i))


def model(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Elementwise, so batch-independent: bit-exact whatever the batches."""
    return {"depth": torch.tanh(x[:, :1] * 1.7 + 0.3), "feat": (x * 3 - 1).to(torch.bfloat16)}


class DieAtWrite(LocalFS):
    """SIGKILL this process at its ``count``-th shard write (rank dst killed while writing)."""

    def __init__(self, count: int) -> None:
        self.count, self.seen, self.name = count, 0, ""

    def write_atomic(self, path, chunks, then=None):
        self.name = path.name  # what write_all writes: a shard, or the run's mark, an index
        return super().write_atomic(path, chunks, then)

    def write_all(self, fd, chunks):
        self.seen += bool(SHARD_NAME.fullmatch(self.name))
        if self.seen == self.count and SHARD_NAME.fullmatch(self.name):
            super().write_all(fd, list(chunks)[:1])  # half a file: the temporary name a killed writer leaves
            time.sleep(1.0)  # the earlier shards' fsync and rename (a background thread) finish first
            os.kill(os.getpid(), signal.SIGKILL)
        return super().write_all(fd, chunks)


class DieAtPut(ObjectStore):
    """SIGKILL this process in the middle of its ``count``-th shard upload (rank dst killed while uploading one)."""

    def __init__(self, url: str, storage_options: dict, count: int) -> None:
        super().__init__(url, storage_options)
        self.count, self.seen = count, 0

    def put(self, name, chunks, then=None):
        self.seen += bool(SHARD_NAME.fullmatch(name))  # not the run's mark
        if self.seen != self.count or not SHARD_NAME.fullmatch(name):
            return super().put(name, chunks, then)

        data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
        self.block_bytes = max(1, len(data) // 3)  # parts of a third: a multipart upload, even of a small shard

        def half():
            yield data[: 2 * self.block_bytes]  # the upload has begun, two parts sent: then the process dies
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

        return super().put(name, half(), then)


def case_run(
    out: str,
    resume: bool,
    kill: dict | None = None,
    batch: int = 4,
    layout: str = "same",
    ranks_per_writer: int | None = None,
    storage_options: dict | None = None,
) -> dict:
    """One attempt: ``kill`` = {"rank": r, "batch": b} (a rank) or {"rank": r, "write": n} (a writer).

    ``storage_options``: ``out`` is an object store URL (a writer killed in the middle of an upload).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    sink = None
    if kill and kill["rank"] == rank and "write" in kill:
        if storage_options is not None:
            sink = functools.partial(DatasetWriter, store=DieAtPut(out, storage_options, kill["write"]))
        else:
            sink = functools.partial(DatasetWriter, fs=DieAtWrite(kill["write"]))
    col = tdgather.Collector(
        out,
        resume=resume,
        overwrite=not resume,
        duplicates="exact",
        memory_budget=96 << 10,
        chunk_bytes=16 << 10,
        timeout=60,
        ranks_per_writer=ranks_per_writer,
        sink=sink,
        storage_options=storage_options,
    )
    with col:
        todo = col.saved.todo(samples())
        sampler = DistributedSampler(todo, num_replicas=world, rank=rank, shuffle=True, seed=0)
        for b, (names, idx) in enumerate(DataLoader(todo, batch_size=batch, sampler=sampler)):
            if kill and kill["rank"] == rank and kill.get("batch") == b:
                _wait_for_every_first_add(out, resume, world)
                os.kill(os.getpid(), signal.SIGKILL)
            x = torch.stack([frame_input(n, int(i)) for n, i in zip(names, idx, strict=True)])
            out_frames = model(x)
            if layout == "wider":  # a different model on resume: another shape (a dim after the first), same filenames
                out_frames["depth"] = torch.cat([out_frames["depth"]] * 2, dim=2)
            col.add(names, idx, out_frames)
            if kill and "batch" in kill and b == 0:
                _stamp(out, resume, rank).touch()
    return {"todo": len(todo), "saved_frames": col.saved.num_frames, "saved_files": len(col.saved)}


def _wait_for_every_first_add(out: str, resume: bool, world: int) -> None:
    """Before a rank is killed: every other rank has added a batch, so each writer holds frames of its
    own to save (on a loaded machine a writer could otherwise lose its peer before its first add)."""
    deadline = time.monotonic() + 30
    stamps = [_stamp(out, resume, r) for r in range(world)]
    while not all(p.exists() for p in stamps if p != stamps[dist.get_rank()]) and time.monotonic() < deadline:
        time.sleep(0.01)
    for p in stamps:
        p.unlink(missing_ok=True)


def _stamp(out: str, resume: bool, rank: int) -> Path:
    """Where ``rank`` notes its first add, outside the output's directory (which tests list)."""
    key = hashlib.sha1(f"{out}\0{resume}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"tdgather-test-added-{key}-{rank}"


def case_run_reporting(out: str, resume: bool, layout: str) -> dict:
    """`case_run`, returning the error each rank saw instead of raising."""
    try:
        return {"ok": case_run(out, resume, layout=layout)}
    except tdgather.TdgatherError as e:
        return {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None)}


def case_run_in_scratch(scratch: str, out: str, ranks_per_writer: int, storage_options: dict) -> dict:
    """`case_run` from a scratch directory of this rank's own (its cwd and TMPDIR): nothing on disk is shared."""
    import tempfile

    own = os.path.join(scratch, f"rank{dist.get_rank()}")
    os.makedirs(own)
    os.chdir(own)
    os.environ["TMPDIR"] = own
    tempfile.tempdir = None
    result = case_run(out, False, ranks_per_writer=ranks_per_writer, storage_options=storage_options)
    return {**result, "scratch": sorted(os.listdir(own))}


def case_gather_save(url: str, storage_options: dict) -> dict:
    """Each rank one clip; ``gather`` then ``save`` to an object store URL on rank 0."""
    rank = dist.get_rank()
    store = tdgather.FrameStore()
    store.add([f"clip_{rank}.mp4"] * 3, [0, 1, 2], {"depth": torch.full((3, 2, 2), float(rank))})
    got = tdgather.gather(store)
    saved = tdgather.save(got, url, storage_options=storage_options) if got is not None else None
    return {"saved": None if saved is None else str(saved)}


def case_job(
    out: str, job: str, tmp: str, storage_options: dict | None, hold: bool, kill_at_open: bool = False
) -> dict:
    """One copy of a job (``overwrite=True``): 4 batches a rank, each spilled and written at once.

    ``hold``: once rank 0 has written a shard, it stamps ``<job>-open`` and waits for ``go`` (the other
    copy runs meanwhile). ``kill_at_open``: rank 0 is SIGKILLed right after the Collector opens.
    """
    rank = dist.get_rank()
    try:
        with tdgather.Collector(
            out,
            overwrite=True,
            resume=not hold and not kill_at_open and job.startswith("resume"),
            memory_budget=16 << 10,
            chunk_bytes=1,
            timeout=60,
            progress=False,
            storage_options=storage_options,
        ) as col:
            if kill_at_open and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            for b in range(4):
                value = float(ord(job[0])) + b
                col.add([f"{job}_{rank}.mp4"] * 2, [2 * b, 2 * b + 1], torch.full((2, 64), value))
                if hold and rank == 0 and b == 1:
                    _wait_until(lambda: col.status().shards >= 1, "a shard written")
                    Path(tmp, f"{job}-open").touch()
                    _wait_until(Path(tmp, "go").exists, "the other job")
        return {"type": None}
    except tdgather.TdgatherError as e:
        return {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None)}
