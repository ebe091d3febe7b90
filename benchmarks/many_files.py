"""``python -m benchmarks.many_files``: one-frame filenames by the hundred thousand, on a 2-rank local world.

Two figures, each against its own baseline in the same run:

- ``--memory N``: rank dst's peak resident memory (VmHWM) while a Collector under a 16 MiB budget
  takes N one-frame filenames, minus the same for 2,000 filenames: bytes per filename.
- ``--resume N``: a run that saves N one-frame filenames fails; a ``resume=True`` run sends them all
  again. Reported: its ``close_seconds`` (re-sent copies compared with the disk), beside the loop.
- ``--close N``: N one-frame filenames of 1 KB (``float32[256]``, batches of 500) at 2 ranks, the
  Collector's default (or ``--ranks-per-writer k``) from open to close against the same outputs
  written by hand: each rank keeps its batches, sorts its filenames, writes one safetensors file and
  a JSON of each filename's row, and fsyncs both. Figure: the slowest rank's seconds from a barrier
  to its last write (median of ``--repeats``), and the Collector's over the hand-written's, in the
  same world; also each repeat's ratio (the two run back to back), steadier where the page cache
  makes the hand-written files take 0.12 s in one repeat and 0.23 s in the next.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file

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


def _by_hand(out: str, names: list[str], batches: list[torch.Tensor]) -> None:
    """What a user writes without a library: one sorted safetensors file and a JSON of rows, per rank."""
    order = sorted(range(len(names)), key=names.__getitem__)
    frames = torch.cat(batches)[torch.tensor(order)]
    stem = f"{out}/rank{dist.get_rank()}"
    save_file({"frames": frames}, f"{stem}.safetensors")
    with open(f"{stem}.json", "w") as fh:
        json.dump({names[i]: row for row, i in enumerate(order)}, fh)
    for path in (f"{stem}.safetensors", f"{stem}.json"):
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def case_close(out: str, n: int, repeats: int, writers: int | None = None) -> dict | None:
    """Seconds of the Collector and of the hand-written files, each the slowest rank's, per repeat."""
    rank, world, batch = dist.get_rank(), dist.get_world_size(), 500
    names = [f"img_{i:07d}.jpg" for i in range(rank, n, world)]
    chunks = [names[i : i + batch] for i in range(0, len(names), batch)]
    outputs = [torch.randn(len(c), 256) for c in chunks]  # the model's batches, made before the clock
    times: dict[str, list[float]] = {"collector": [], "by_hand": []}
    for r in range(repeats + 1):  # the first is a warm-up
        for how in times:
            where = f"{out}/{how}{r}"
            os.makedirs(where, exist_ok=True)
            dist.barrier()
            start = time.perf_counter()
            if how == "collector":
                kw = {"ranks_per_writer": writers} if writers else {}
                with tdgather.Collector(where, timeout=600, progress=False, log_summary=False, **kw) as col:
                    for c, o in zip(chunks, outputs, strict=True):
                        col.add(c, [0] * len(c), o)
            else:
                _by_hand(where, [name for c in chunks for name in c], list(outputs))
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if r:
                times[how].append(took.item())
    return times if rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.many_files", description=__doc__.split("\n")[0])
    parser.add_argument("--memory", type=int, nargs="*", default=[], help="filenames for the memory figure")
    parser.add_argument("--resume", type=int, nargs="*", default=[], help="filenames re-sent on resume")
    parser.add_argument("--close", type=int, nargs="*", default=[], help="filenames for the close figure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks-per-writer", type=int, help="--close: the Collector's ranks_per_writer (default none)")
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
    for n in args.close:
        with tempfile.TemporaryDirectory() as d:
            t = run_local_world(case_close, 2, d, n, args.repeats, args.ranks_per_writer, timeout=1800)[0]
        col, hand = statistics.median(t["collector"]), statistics.median(t["by_hand"])
        ratios = [c / h for c, h in zip(t["collector"], t["by_hand"], strict=True)]  # each repeat's pair
        writers = f", ranks_per_writer={args.ranks_per_writer}" if args.ranks_per_writer else ""
        print(
            f"close {n} one-frame filenames{writers}: "
            f"Collector {col:.2f} s, by hand {hand:.2f} s: {col / hand:.2f}x; each repeat's ratio "
            f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}x) "
            f"(Collector {', '.join(f'{x:.2f}' for x in t['collector'])}; "
            f"by hand {', '.join(f'{x:.2f}' for x in t['by_hand'])})"
        )


if __name__ == "__main__":
    main()
