"""``python -m benchmarks.many_files``: one-frame filenames by the hundred thousand, on a 2-rank local world.

Two figures, each against its own baseline in the same run:

- ``--memory N``: rank dst's peak resident memory (VmHWM) while a Collector under a 16 MiB budget
  takes N one-frame filenames, minus the same for 2,000 filenames: bytes per filename.
- ``--resume N``: a run that saves N one-frame filenames fails; a ``resume=True`` run sends them all
  again. Reported: its ``close_seconds`` (re-sent copies compared with the disk), beside the loop.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.launch import run_local_world

BATCH = 1000


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _add_all(col: tdgather.Collector, names: list[str]) -> None:
    frame = torch.arange(4, dtype=torch.float32)
    for i in range(0, len(names), BATCH):
        batch = names[i : i + BATCH]
        col.add(batch, [0] * len(batch), frame.expand(len(batch), 4).clone())


def case_memory(out: str, per_rank: int, budget: int) -> dict | None:
    rank = dist.get_rank()
    with tdgather.Collector(out, memory_budget=budget, timeout=600, progress=False) as col:
        _add_all(col, [f"img_{rank}_{i}.jpg" for i in range(per_rank)])
    return {"hwm": _status("VmHWM"), "frames": col.summary.frames} if rank == 0 else None


def case_resume(out: str, n: int, phase: str) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [f"img_{i}.jpg" for i in range(rank, n, world)]
    if phase == "fail":
        try:
            with tdgather.Collector(out, memory_budget=1 << 20, timeout=600, progress=False) as col:
                _add_all(col, names)
                raise RuntimeError("a planned failure, after every frame was added")
        except (RuntimeError, tdgather.PeerError):
            return None
    start = time.perf_counter()
    with tdgather.Collector(out, memory_budget=16 << 20, timeout=600, progress=False, resume=True) as col:
        _add_all(col, names)
    if rank != 0:
        return None
    s = col.summary
    return {"close": s.close_seconds, "total": time.perf_counter() - start, "dropped": s.duplicates_dropped}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.many_files", description=__doc__.split("\n")[0])
    parser.add_argument("--memory", type=int, nargs="*", default=[], help="filenames for the memory figure")
    parser.add_argument("--resume", type=int, nargs="*", default=[], help="filenames re-sent on resume")
    parser.add_argument("--budget-mib", type=int, default=16)
    args = parser.parse_args(argv)
    budget = args.budget_mib << 20
    for n in args.memory:
        with tempfile.TemporaryDirectory() as d:
            base = run_local_world(case_memory, 2, d + "/base", 1000, budget, timeout=900)[0]
            run = run_local_world(case_memory, 2, d + "/run", n // 2, budget, timeout=900)[0]
        grown = run["hwm"] - base["hwm"]
        print(
            f"memory {n} filenames, budget {args.budget_mib} MiB: rank dst peak +{grown / 1e6:.1f} MB over "
            f"2,000 filenames, {grown / max(1, n - 2000):.0f} B/filename ({run['frames']} frames)"
        )
    for n in args.resume:
        with tempfile.TemporaryDirectory() as d:
            run_local_world(case_resume, 2, d + "/ds", n, "fail", timeout=900)
            r = run_local_world(case_resume, 2, d + "/ds", n, "resume", timeout=900)[0]
        print(f"resume {n} re-sent filenames: close {r['close']:.2f} s of {r['total']:.2f} s, {r['dropped']} dropped")


if __name__ == "__main__":
    main()
