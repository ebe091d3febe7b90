"""World cases for the same-host path: a Collector whose senders share rank dst's host."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import tdgather


def frames(rank: int, b: int) -> dict:
    g = torch.Generator().manual_seed(rank * 1000 + b)
    n = b % 4
    return {"x": torch.rand(8, 300, generator=g), "boxes": torch.rand(8, n, 4, generator=g)}


def case_collect(path: str, env: dict, batches: int = 24, orphan: str | None = None) -> dict | None:
    """Every rank adds ``batches`` batches of 8 frames under ``env``; rank 0 reads the dataset back."""
    os.environ.update(env)
    rank = dist.get_rank()
    with tdgather.Collector(path, progress=False, memory_budget=8 << 20) as col:
        for b in range(batches):
            col.add([f"r{rank}_{b % 3}.mp4"] * 8, torch.arange(8) + 8 * (b // 3), frames(rank, b))
    dist.barrier()  # every sender has cleaned up
    left = sorted(f for f in os.listdir(env["TDGATHER_SHM_DIR"])) if "TDGATHER_SHM_DIR" in env else []
    if rank:
        return {"left": left}
    ds = tdgather.open(path)
    for r in range(dist.get_world_size()):
        for b in range(batches):
            got = ds[f"r{r}_{b % 3}.mp4"]
            want = frames(r, b)
            rows = slice(8 * (b // 3), 8 * (b // 3) + 8)
            assert torch.equal(got.frames["x"][rows], want["x"]), (r, b)
            for k, box in enumerate(got.frames["boxes"].unbind()[rows]):
                assert torch.equal(box, want["boxes"][k]), (r, b, k)
    return {"shared": col.summary.shared_chunks, "frames": col.summary.frames, "left": left}
