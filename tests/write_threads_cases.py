"""World cases for `Collector(write_threads=...)`: shards written on several threads, from a slow disk."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

import tdgather
from tdgather.storage.atomic import LocalFS
from tdgather.storage.writer import DatasetWriter

FRAME = (3, 32, 32)  # float32: 12 KiB a frame


class SlowFS(LocalFS):
    """A disk that takes 30 ms a ``writev``: shards being written overlap the next chunks arriving."""

    def writev(self, fd: int, views: list) -> None:
        time.sleep(0.03)
        super().writev(fd, views)


def batches(rank: int, frames: int = 480, batch: int = 8):
    """Rank ``rank``'s outputs: two videos a rank, taking batches in turn, a new tensor of distinct values a batch.

    A batch's frames are one video's and in order: runs long enough to be written from the received
    buffers (`tdgather.core.merge.REF_RUN_BYTES`), not merged into new ones first.
    """
    g = torch.Generator().manual_seed(rank)
    for lo in range(0, frames, batch):
        idx = torch.arange(lo, lo + batch)
        names = [f"r{rank}_v{lo // batch % 2}.mp4"] * batch
        yield names, idx, torch.randn((batch, *FRAME), generator=g)


class KillMidShard(SlowFS):
    """SIGKILL this process while its ``count``-th shard is half written, the other write threads busy beside it."""

    def __init__(self, count: int) -> None:
        self.count, self.seen, self.lock, self.local = count, 0, threading.Lock(), threading.local()

    def write_atomic(self, path, chunks, then=None):
        self.local.name = path.name  # what write_all writes, on this thread
        return super().write_atomic(path, chunks, then)

    def write_all(self, fd, chunks):
        if self.local.name.startswith("shard-"):
            with self.lock:
                self.seen += 1
                mine = self.seen
            if mine == self.count:
                super().write_all(fd, list(chunks)[:1])  # half a file, under its temporary name
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().write_all(fd, chunks)


def case_threads(out: str, threads: int, shm: bool, slow: bool, kill: int = 0, resume: bool = False) -> dict | None:
    """Every rank's batches through a small budget (many spills, many shards); rank dst's summary.

    ``kill``: rank dst is killed mid-way through its ``kill``-th shard; ``resume``: the run goes on
    from what an attempt before saved, every frame sent again (copies of saved ones must be exact).
    """
    os.environ["TDGATHER_SHM"] = "1" if shm else "0"
    rank = dist.get_rank()
    fs = KillMidShard(kill) if kill and rank == 0 else SlowFS() if slow else None
    sink = (lambda path, **kw: DatasetWriter(path, fs=fs, **kw)) if fs is not None else None
    kw = dict(timeout=60, progress=False, memory_budget=8 << 20, chunk_bytes=800 << 10, max_shard_bytes=1 << 20)
    kw |= {"resume": True, "duplicates": "exact"} if resume else {}
    with tdgather.Collector(out, write_threads=threads, sink=sink, **kw) as col:
        for names, idx, x in batches(rank):
            col.add(names, idx, x)
    s = col.summary
    return None if s is None else {"frames": s.frames, "shards": s.shards, "shared": s.shared_chunks}
