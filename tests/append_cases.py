"""Jobs that append to one dataset (tests/test_append.py): plain processes and 2-rank gloo worlds.

Every job holds frames of a few filenames, shares overlapping other jobs' (a frame sent by
several jobs must be in the dataset once). A frame's value depends only on its filename and
frame index, so any copy kept is checkable bit for bit.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

import tdgather

FILENAMES = [f"clip_{k}.mp4" for k in range(6)]


def value(name: str, idx: int) -> dict:
    """Frame ``idx`` of ``name``: boxes of 1 to 3 rows and a score, from the two alone."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + idx)
    return {"boxes": torch.rand(idx % 3 + 1, 4, generator=g), "score": torch.rand((), generator=g)}


def share(job: int) -> dict[str, list[int]]:
    """Job ``job``'s frames: 6 of two filenames (overlapping its neighbours'), and 2 of a filename of its own."""
    a, b = FILENAMES[job % 6], FILENAMES[(job + 1) % 6]
    return {a: list(range(2 * job, 2 * job + 6)), b: list(range(job, job + 6)), f"own_{job}.mp4": [0, 1]}


def expected(jobs: range | list[int], share_of: Callable[[int], dict[str, list[int]]] = share) -> dict[str, set[int]]:
    """Every frame the jobs send (each job's frames as ``share_of`` gives them), once."""
    out: dict[str, set[int]] = {}
    for job in jobs:
        for name, frames in share_of(job).items():
            out.setdefault(name, set()).update(frames)
    return out


def sent(jobs: range | list[int]) -> int:
    """The frames the jobs send, copies included."""
    return sum(len(frames) for job in jobs for frames in share(job).values())


def _add(col: tdgather.Collector, frames: list[tuple[str, int]], pause: float) -> None:
    for name, idx in frames:  # one frame a batch, as a slow model's loop adds them
        col.add([name], [idx], [value(name, idx)])
        time.sleep(pause)


def plain_job(path: str, job: int, pause: float = 0.0, *, storage_options: dict | None = None) -> None:
    """One process, no process group: the job's frames through a Collector that appends (``storage_options``: S3's)."""
    frames = [(name, idx) for name, idxs in share(job).items() for idx in idxs]
    with tdgather.Collector(
        path, append=True, storage_options=storage_options, progress=False, log_summary=False
    ) as col:
        _add(col, frames, pause)


def world_job(path: str, job: int) -> int:
    """A 2-rank gloo world (each rank half the job's frames) appending through rank 0."""
    frames = [(name, idx) for name, idxs in share(job).items() for idx in idxs]
    with tdgather.Collector(path, append=True, progress=False, log_summary=False) as col:
        _add(col, frames[dist.get_rank() :: dist.get_world_size()], 0.0)
    return dist.get_rank()


def check(ds: tdgather.Dataset) -> dict[str, list[int]]:
    """Every frame of ``ds`` read and compared with its value; its frame indexes per filename."""
    out = {}
    for name in ds:
        clip = ds[name]
        out[name] = clip.frame_idx.tolist()
        for k, idx in enumerate(out[name]):
            want = value(name, idx)
            got = clip.frames[k]
            assert torch.equal(got["boxes"], want["boxes"]) and torch.equal(got["score"], want["score"]), (name, idx)
    return out
