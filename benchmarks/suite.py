"""``python -m benchmarks.suite``: tdgather against the usual methods and the physical limit, in one run.

Every (world size, workload, method) runs in a fresh local gloo world (its own processes).
Each rank generates its share of the workload (untimed), calls the method once to warm up, then
``--repeats`` times between barriers. The figure is rank 0's wall time from the barrier to the
method's return on rank 0 (the moment rank 0 holds everything), median of the repeats; what the
method returns is freed after the clock stops. Rank 0 samples its anonymous resident memory plus
the host's shared memory (`benchmarks.memory.resident`'s ``Held``: a result placed in a memfd
counts) every 2 ms; the peak above the value before each call, over the bytes it received, is the
memory multiple.

Run ``python -m benchmarks.suite --help``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from tdgather.tools.launch import WorldError, run_local_world

from .memory import PeakSampler
from .methods import METHODS, RankData, skip_reason
from .report import write_report
from .workloads import WORKLOADS, batches

QUICK = {"scale": 0.03, "repeats": 2, "worlds": [2, 4], "workloads": ["large", "tiny", "skewed", "mixed"]}
FULL = {"scale": 1.0, "repeats": 3, "worlds": [2, 4], "workloads": list(WORKLOADS)}


def bench_rank(
    method: str, workload: str, scale: float, repeats: int, scratch: str, budget: int, shm: bool = True
) -> dict:
    """Run on every rank: prepare, warm up, time ``repeats`` calls; rank 0 returns the figures.

    ``shm``: a Collector's senders on rank 0's host use shared memory (else every byte goes over gloo).
    """
    os.environ["TDGATHER_SHM"] = "1" if shm else "0"
    rank = dist.get_rank()
    data = RankData.build(list(batches(workload, rank, dist.get_world_size(), scale=scale)), scratch)
    data.collector_budget = budget
    if method == "td_gather_and_stack" and len(set(data.sizes[1:])) != 1:
        return {"skipped": "senders hold different frame counts"}
    fn = METHODS[method]
    sampler = PeakSampler() if rank == 0 else None
    dist.barrier()
    if sampler:
        sampler.reset()
    held = fn(data)  # the warm-up: the first call in a fresh process, so its memory is all new (none reused)
    peaks = [sampler.close()["Held"]] if sampler else []
    del held
    _remove_written(data)
    times, closes = [], []
    for _ in range(repeats):
        gc.collect()
        dist.barrier()
        start = time.perf_counter()
        held = fn(data)
        seconds = time.perf_counter() - start
        done = time.time()
        del held  # freed after the clock stops: rank 0 holds everything once the method returns
        times.append(seconds)
        if method == "tdgather_collector":
            last = [0.0] * dist.get_world_size()
            dist.all_gather_object(last, data.last_add)
            closes.append(done - max(last))
        _remove_written(data)
    dist.barrier()
    if rank != 0:
        return {}
    return {"times": times, "peaks": peaks, "closes": closes, "received": sum(data.sizes[1:]), "total": sum(data.sizes)}


def _remove_written(data: RankData) -> None:
    """Delete what a method wrote, untimed, as disk_raw deletes its file: the page cache then reuses its
    pages, as on a host that has run a while. On these VMs a page the guest never touched costs ~3 ms/MB
    to write into the first time, which would otherwise be charged to every writing method."""
    dist.barrier()
    if dist.get_rank() == 0:
        for path in data.written:
            shutil.rmtree(path, ignore_errors=True)
    data.written.clear()


def run_suite(
    worlds: list[int],
    workloads: list[str],
    methods: list[str],
    scale: float,
    repeats: int,
    budget: int,
    timeout: float,
    shm: bool = True,
) -> list[dict]:
    """Run every combination; return one row per (world, workload, method); ``shm``: see `bench_rank`."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="tdgather-bench-") as scratch:
        for world in worlds:
            for workload in workloads:
                for method in methods:
                    t0 = time.perf_counter()
                    row = {"world": world, "workload": workload, "method": method}
                    try:
                        row |= _run_one(world, method, workload, scale, repeats, scratch, budget, timeout, shm)
                    except WorldError as e:
                        row["error"] = str(e).splitlines()[0] + " " + _last_error_line(e)
                    rows.append(row)
                    status = row.get("error") or row.get("skipped") or f"median {statistics.median(row['times']):.3f} s"
                    print(
                        f"world {world} {workload:<7} {method:<20} {status}  ({time.perf_counter() - t0:.1f} s)",
                        flush=True,
                    )
    return rows


def _run_one(
    world: int,
    method: str,
    workload: str,
    scale: float,
    repeats: int,
    scratch: str,
    budget: int,
    timeout: float,
    shm: bool = True,
) -> dict:
    """Rank 0's figures of one method on one workload, in a fresh local world; or why it is skipped."""
    skipped = skip_reason(method, workload)
    if skipped:
        return {"skipped": skipped}
    args = (method, workload, scale, repeats, scratch, budget, shm)
    return run_local_world(bench_rank, world, *args, timeout=timeout)[0]


def _last_error_line(e: WorldError) -> str:
    lines = [line for msg in e.failures.values() for line in msg.strip().splitlines()]
    return lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (x0.03), 2 repeats: under 2 minutes")
    parser.add_argument("--worlds", type=int, nargs="+", help="world sizes (default 2 4)")
    parser.add_argument(
        "--workloads", nargs="+", choices=list(WORKLOADS), help="default: all (quick: not large_whole, detection)"
    )
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--repeats", type=int, help="timed repeats after the warm-up (default 3, quick 2)")
    parser.add_argument("--scale", type=float, help="workload scale (default 1, quick 0.03)")
    parser.add_argument("--budget-mib", type=int, default=256, help="the Collector's memory budget")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for one method's world")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="where the report goes")
    parser.add_argument("--no-report", action="store_true", help="print only, write no report")
    path = parser.add_mutually_exclusive_group()
    path.add_argument(
        "--same-host", action="store_true", help="senders on rank 0's host use shared memory (the default)"
    )
    path.add_argument("--gloo-only", action="store_true", help="every byte over gloo (TDGATHER_SHM=0), as before")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    worlds = args.worlds or preset["worlds"]
    scale = args.scale if args.scale is not None else preset["scale"]
    repeats = args.repeats or preset["repeats"]
    t0 = time.perf_counter()
    rows = run_suite(
        worlds,
        args.workloads or preset["workloads"],
        args.methods,
        scale,
        repeats,
        args.budget_mib << 20,
        args.timeout,
        not args.gloo_only,
    )
    command = "python -m benchmarks.suite " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"suite: {time.perf_counter() - t0:.0f} s")
    if not args.no_report:
        md = write_report(rows, Path(args.out), command, scale, repeats, args.budget_mib, time.perf_counter() - t0)
        print(f"report: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
