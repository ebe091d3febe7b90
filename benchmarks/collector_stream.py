"""The Collector under a memory budget: several GiB through rank 0, and the cost of closing.

Run: ``python -m benchmarks.collector_stream --gib 3 --budget-mib 256 --world 4``

Every rank but 0 streams its share of ``--gib`` GiB of 3x64x64 float32 frames (round-robin
over 200 videos, so every video is split over the ranks). Rank 0 samples its resident memory
every 2 ms: anonymous (data) and file-backed (library code paged in), above its baseline.
The close latency is from the last ``add()`` on any rank to rank 0's ``close()`` returning.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.launch import run_local_world

from .memory import PeakSampler

FRAME = (3, 64, 64)


def _rank(out: str, gib: float, budget: int, batch: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    frame_bytes = 4 * FRAME[0] * FRAME[1] * FRAME[2]
    total = int(gib * 2**30) // frame_bytes
    mine = list(range(rank - 1, total, world - 1)) if rank else []
    sampler = PeakSampler()
    frames = torch.rand((batch, *FRAME))
    t0 = time.time()
    with tdgather.Collector(out, memory_budget=budget, timeout=600, progress=False) as col:
        for i in range(0, len(mine), batch):
            pos = mine[i : i + batch]
            col.add([f"video_{p % 200:03d}.mp4" for p in pos], [p // 200 for p in pos], frames[: len(pos)])
        last_add = time.time()
    closed = time.time()
    peak = sampler.close()
    result = {"rank": rank, "last_add": last_add, "closed": closed, "start": t0}
    if col.summary is not None:
        s = col.summary
        result |= {
            "frames": s.frames,
            "bytes": s.bytes,
            "shards": s.shards,
            "seconds": s.seconds,
            "anon": peak["RssAnon"],
            "file": peak["RssFile"],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=3.0)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tdgather-bench-") as tmp:
        out = run_local_world(_rank, args.world, f"{tmp}/ds", args.gib, args.budget_mib << 20, args.batch, timeout=1800)
        ds = tdgather.open(f"{tmp}/ds")
        assert ds.metadata["total_frames"] == out[0]["frames"]
    r0 = out[0]
    last_add = max(r["last_add"] for r in out)
    transfer = r0["closed"] - min(r["start"] for r in out)
    close = r0["closed"] - last_add
    print(
        "| world | total GiB | budget MiB | peak anon MiB | peak file MiB | shards | seconds | MB/s | close s |", end=""
    )
    print(" close / total |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.world} | {r0['bytes'] / 2**30:.2f} | {args.budget_mib} | {r0['anon'] / 2**20:.0f} | "
        f"{r0['file'] / 2**20:.0f} | {r0['shards']} | {transfer:.1f} | {r0['bytes'] / 1e6 / transfer:.0f} | "
        f"{close:.3f} | {100 * close / transfer:.1f}% |"
    )


if __name__ == "__main__":
    main()
