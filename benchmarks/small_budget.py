"""``python -m benchmarks.small_budget``: small frames over a shuffled sampler, under a small and a large budget.

Every rank (rank 0 too) predicts its share of ``--videos`` videos x ``--frames`` frames of ``--frame-bytes``
bytes, drawn by a shuffled ``DistributedSampler`` in batches of ``--batch``, into a Collector
under each ``--budget-mib``. Reported per budget, on rank 0: its peak resident memory (anonymous)
above the value before the Collector opened, the Collector's seconds, the shards written, the most
segments a filename has, and the time to read one filename from the saved dataset (the mean over
``--reads`` filenames, the dataset opened once before).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import tdgather
from tdgather.tools.launch import run_local_world

from .memory import PeakSampler

__all__ = ["main", "run_rank"]


def run_rank(out: str, videos: int, frames: int, frame_bytes: int, batch: int, budget: int) -> dict | None:
    """One rank: its shuffled share of every (video, frame), added batch by batch; rank 0 returns the figures."""
    rank = dist.get_rank()
    samples = list(range(videos * frames))
    sampler = DistributedSampler(samples, shuffle=True, seed=0)  # needs the process group: rank and world
    mine = torch.tensor(list(sampler), dtype=torch.int64)
    value = torch.rand(batch, frame_bytes // 4)
    names = [f"video_{v:05d}.mp4" for v in range(videos)]
    peak = PeakSampler() if rank == 0 else None
    start = time.perf_counter()
    with tdgather.Collector(out, memory_budget=budget, timeout=600, progress=False, overwrite=True) as col:
        for i in range(0, mine.numel(), batch):
            pos = mine[i : i + batch]
            col.add([names[p] for p in (pos // frames).tolist()], pos % frames, value[: pos.numel()])
    seconds = time.perf_counter() - start
    if peak is None:
        return None
    held = peak.close()["RssAnon"]
    return {"peak": held, "seconds": seconds, "shards": col.summary.shards, "frames": col.summary.frames}


def read_figures(path: str, reads: int) -> dict:
    """The most segments a filename has, and the mean seconds to read one filename (after a first read)."""
    ds = tdgather.open(path)
    names = list(ds)
    most = max(len(ds.index["files"][n]["segments"]) for n in names)
    ds[names[0]]  # the first read opens shards: not counted
    step = max(1, len(names) // reads)
    chosen = names[::step][:reads]
    start = time.perf_counter()
    for name in chosen:
        ds[name]
    return {"segments": most, "read_ms": 1e3 * (time.perf_counter() - start) / len(chosen)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.small_budget", description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--videos", type=int, default=1000)
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--frame-bytes", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budget-mib", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--reads", type=int, default=200)
    args = parser.parse_args(argv)
    print("| budget MiB | rank 0 peak MiB | seconds | shards | segments (most) | read ms |")
    print("|---|---|---|---|---|---|")
    for mib in args.budget_mib:
        with tempfile.TemporaryDirectory(prefix="tdgather-bench-") as tmp:
            out = f"{tmp}/ds"
            job = (out, args.videos, args.frames, args.frame_bytes, args.batch, mib << 20)
            r0 = run_local_world(run_rank, args.world, *job, timeout=1800)[0]
            assert r0["frames"] == args.videos * args.frames
            reads = read_figures(out, args.reads)
        print(
            f"| {mib} | {r0['peak'] / 2**20:.1f} | {r0['seconds']:.2f} | {r0['shards']} | {reads['segments']} | "
            f"{reads['read_ms']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
