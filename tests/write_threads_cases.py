"""World cases for `Collector(write_threads=...)`: shards written on several threads, from a slow disk."""

from __future__ import annotations

import os
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


def case_threads(out: str, threads: int, shm: bool, slow: bool) -> dict | None:
    """Every rank's batches through a small budget (many spills, many shards); rank dst's summary."""
    os.environ["TDGATHER_SHM"] = "1" if shm else "0"
    rank = dist.get_rank()
    sink = (lambda path, **kw: DatasetWriter(path, fs=SlowFS(), **kw)) if slow else None
    kw = dict(timeout=60, progress=False, memory_budget=8 << 20, chunk_bytes=800 << 10, max_shard_bytes=1 << 20)
    with tdgather.Collector(out, write_threads=threads, sink=sink, **kw) as col:
        for names, idx, x in batches(rank):
            col.add(names, idx, x)
    s = col.summary
    return None if s is None else {"frames": s.frames, "shards": s.shards, "shared": s.shared_chunks}
