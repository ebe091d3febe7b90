"""A 2-rank Collector job for tests/test_sigterm.py, run under a real torchrun: it waits to be stopped.

Usage: ``torchrun --nproc-per-node=2 tests/sigterm_job.py OUT READY_DIR``. Rank 0 adds 500 frames
itself, rank 1 adds 50; each then writes ``READY_DIR/rank<r>.pid`` and sleeps until it is stopped.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tdgather


def main() -> None:
    out, ready = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = 500 if rank == 0 else 50
    with tdgather.Collector(out, timeout=60, progress=False) as col:
        for start in range(0, n, 100):
            count = min(100, n - start)
            names = [f"r{rank}_{i:04d}.jpg" for i in range(start, start + count)]
            col.add(names, list(range(count)), torch.arange(start, start + count, dtype=torch.float32).repeat(8, 1).T)
        (ready / f"rank{rank}.pid").write_text(str(os.getpid()))
        time.sleep(120)  # stopped by the test long before this


if __name__ == "__main__":
    main()
