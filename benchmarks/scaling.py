"""Scaling with the number of ranks: 2 to 32 processes, the same bytes per sender.

Every rank holds ``--mb`` MB of 3x32x32 float32 frames, its round-robin share of videos that
span all ranks (so rank 0 merges split files). Rank 0 therefore receives (W - 1) x MB. For each
world size, in one fresh world per method, each method runs once to warm up and then
``--repeats`` times between barriers. Reported, on rank 0:

- seconds: wall time from the barrier to the return on rank 0 (median);
- rank 0 CPU seconds: user + system time of rank 0's process during the call (its threads
  included), the cost that must stay linear in the bytes received, not grow with W squared;
- the time to make a side gloo group over the world (``dist.new_group(backend="gloo")``), what
  tdgather pays once when the default group is NCCL.

Run ``python -m benchmarks.scaling --help``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tdgather.launch import run_local_world

from .methods import METHODS, RankData
from .report import machine

FRAME = (3, 32, 32)
DEFAULT_METHODS = ["raw_p2p", "tdgather_store", "gather_object"]


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rank_batches(rank: int, world: int, mb: float, per_video: int = 40, batch: int = 32) -> list:
    """This rank's batches: videos of ``per_video`` frames dealt round-robin over the ranks."""
    frames_per_rank = max(1, round(mb * 1e6 / (4 * torch.Size(FRAME).numel())))
    total = frames_per_rank * world
    positions = torch.arange(rank, total, world)
    out = []
    for i in range(0, positions.numel(), batch):
        pos = positions[i : i + batch]
        names = [f"video_{int(p) // per_video:05d}.mp4" for p in pos]
        out.append((names, pos % per_video, torch.full((pos.numel(), *FRAME), float(rank))))
    return out


def scaling_rank(method: str, mb: float, repeats: int, scratch: str) -> dict:
    """Run on every rank: the side-group cost once, then the method's warm-up and timed calls."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    start = time.perf_counter()
    dist.new_group(backend="gloo")
    dist.barrier()
    side_group = time.perf_counter() - start
    data = RankData.build(rank_batches(rank, world, mb), scratch)
    fn = METHODS[method]
    dist.barrier()
    fn(data)
    times, cpu = [], []
    for _ in range(repeats):
        dist.barrier()
        c0, t0 = _cpu_seconds(), time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - t0)
        cpu.append(_cpu_seconds() - c0)
    dist.barrier()
    if rank != 0:
        return {}
    return {"times": times, "cpu": cpu, "received": sum(data.sizes[1:]), "side_group": side_group}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=DEFAULT_METHODS)
    parser.add_argument("--mb", type=float, default=4.0, help="MB of frames per rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--no-report", action="store_true")
    args = parser.parse_args(argv)
    t_all = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tdgather-scaling-") as scratch:
        for world in args.worlds:
            for method in args.methods:
                r = run_local_world(scaling_rank, world, method, args.mb, args.repeats, scratch, timeout=args.timeout)
                row = {"world": world, "method": method, **r[0]}
                row["seconds"], row["cpu_seconds"] = statistics.median(row["times"]), statistics.median(row["cpu"])
                rows.append(row)
                print(
                    f"world {world:>2} {method:<16} {row['seconds']:.3f} s, rank 0 CPU {row['cpu_seconds']:.3f} s, "
                    f"{row['received'] / 1e6:.0f} MB received, side group {row['side_group']:.3f} s",
                    flush=True,
                )
    command = "python -m benchmarks.scaling " + shlex.join(argv if argv is not None else sys.argv[1:])
    if not args.no_report:
        print(f"report: {write_scaling_report(rows, Path(args.out), command, args, time.perf_counter() - t_all)}")
    return 0


def write_scaling_report(rows: list[dict], out_dir: Path, command: str, args, seconds: float) -> Path:
    """A markdown table per world size, with ratios against raw_p2p and per-MB costs."""
    m = machine()
    date = _dt.date.today().isoformat()
    by = {(r["world"], r["method"]): r for r in rows}
    lines = [
        f"# tdgather scaling, {date}, {m['label']}",
        "",
        f"- command: `{command}` ({args.repeats} timed repeats after one warm-up; {seconds:.0f} s in all)",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram']}; {m['os']}",
        f"- versions: Python {m['python']}, torch {m['torch']}, tensordict {m['tensordict']}",
        f"- workload: {args.mb:g} MB of 3x32x32 float32 frames on every rank, videos of 40 frames dealt round-robin"
        " over all ranks; rank 0 receives (W - 1) times that",
        "- seconds: rank 0's wall time, barrier to return, median; all W processes share the machine's cores,"
        " so wall time includes the senders' packing competing for them",
        "- rank 0 CPU: user + system seconds of rank 0's process during the call; ms/MB: that over MB received",
        "- side group: seconds to make a gloo group over the world, what tdgather pays once under NCCL",
        "",
        "| ranks | MB received | method | seconds | vs raw | vs gather_object | rank 0 CPU s | rank 0 CPU ms/MB |"
        " side group s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        raw, go = by.get((r["world"], "raw_p2p")), by.get((r["world"], "gather_object"))
        mb = r["received"] / 1e6
        cells = [
            str(r["world"]),
            f"{mb:.0f}",
            r["method"],
            f"{r['seconds']:.3f}",
            f"{raw['seconds'] / r['seconds']:.2f}" if raw else "—",
            f"{go['seconds'] / r['seconds']:.1f}" if go else "—",
            f"{r['cpu_seconds']:.3f}",
            f"{1000 * r['cpu_seconds'] / mb:.1f}" if mb else "—",
            f"{r['side_group']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{date}-{m['label']}-scaling.md"
    md.write_text("\n".join(lines) + "\n")
    return md


if __name__ == "__main__":
    sys.exit(main())
