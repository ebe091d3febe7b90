"""World cases for the same-host path: a Collector whose senders share rank dst's host."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tdgather
from tdgather.comm.shmfiles import SHM_NAME, pid_namespace


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


def case_sender_killed(path: str, env: dict, tmp: str, batches: int = 6) -> dict | None:
    """Rank 1 hands ``batches`` chunks over in shm files (its ring among them), then is SIGKILLed.

    Before it dies it leaves beside them an shm file of its own writer that no header named (a chunk it
    was killed writing), and a decoy: an shm file of another writer of its process (another run's).
    Rank 0 returns the error it saw and what is left in the shm file directory once its Collector ended.
    """
    os.environ.update(env)
    rank, where, go = dist.get_rank(), Path(env["TDGATHER_SHM_DIR"]), Path(tmp, "go")
    error = None
    try:
        with tdgather.Collector(path, progress=False, chunk_bytes=1, timeout=30) as col:
            for b in range(batches):
                col.add([f"r{rank}_{b % 3}.mp4"] * 8, torch.arange(8) + 8 * (b // 3), frames(rank, b))
            if rank == 0:
                deadline = time.monotonic() + 60
                while col.status().frames_received[1] < 8 * batches and time.monotonic() < deadline:
                    time.sleep(0.01)
                go.touch()
            else:
                while not go.exists():
                    time.sleep(0.01)
                names = [n.removesuffix(".free") for n in os.listdir(where)]
                mine = [m for m in map(SHM_NAME.fullmatch, names) if m and m[1] == str(os.getpid())]
                writer = mine[0][0].rsplit("-", 1)[0]
                (where / f"{writer}-99").write_bytes(b"x")  # never named in a header
                other = f"tdgather-{os.getpid()}-{pid_namespace()}-{'0' * 8 if mine[0][3] != '0' * 8 else '1' * 8}-0"
                (where / other).write_bytes(b"x")
                Path(tmp, "decoy").write_text(other)
                os.kill(os.getpid(), signal.SIGKILL)
    except tdgather.PeerError as e:
        error = {"type": type(e).__name__, "rank": e.rank}
    return {"error": error, "left": sorted(os.listdir(where))}
