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

With ``--writers 1 2 4 8`` it measures instead one world of ``--worlds[0]`` ranks (16 by default)
collecting with a `tdgather.Collector` that has that many writers (``ranks_per_writer = W /
writers``; 1 is rank 0 alone). Reported, on rank 0 (the coordinator): the frame bytes it receives
from other ranks and the bytes it writes, against the single writer's; the largest any writer
writes; its wall time, barrier to the end of ``close()``; the slowest rank's; and its ``close()``
time, which includes reading every writer's shard records and writing the global index.

Run ``python -m benchmarks.scaling --help``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tdgather.tools.launch import run_local_world

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
        held = fn(data)
        times.append(time.perf_counter() - t0)
        cpu.append(_cpu_seconds() - c0)
        del held  # freed after the clock stops (`benchmarks.suite`)
    dist.barrier()
    if rank != 0:
        return {}
    return {"times": times, "cpu": cpu, "received": sum(data.sizes[1:]), "side_group": side_group}


def writers_rank(k: int | None, mb: float, repeats: int, scratch: str, timeout: float) -> dict:
    """Run on every rank: one warm-up and ``repeats`` Collector runs with a writer per ``k`` ranks."""
    import tdgather

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = rank_batches(rank, world, mb)
    runs = []
    for i in range(repeats + 1):
        out = Path(scratch) / f"writers-{k}-{i}"
        dist.barrier()
        c0, t0 = _cpu_seconds(), time.perf_counter()
        with tdgather.Collector(out, ranks_per_writer=k, progress=False, timeout=timeout) as col:
            for names, idx, x in batches:
                col.add(names, idx, x)
        seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
        slowest = torch.tensor([seconds])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0 and i:  # the first run warms up
            s = col.summary
            block = range(0, k or world)
            received = sum(n for r, n in s.frames_per_rank.items() if int(r) in block and int(r) != 0)
            written: dict[str, int] = {}
            for shard in out.iterdir():
                if shard.name.startswith("shard-"):
                    writer = shard.name.split("-")[1] if k else "0"
                    written[writer] = written.get(writer, 0) + shard.stat().st_size
            runs.append(
                {
                    "seconds": seconds,
                    "cpu": cpu,
                    "slowest": float(slowest),
                    "close": s.close_seconds,
                    "combine": s.combine_seconds,
                    "received": received * 4 * torch.Size(FRAME).numel(),
                    "written": written.get("00000" if k else "0", 0),
                    "largest": max(written.values()),
                    "total": s.bytes,
                }
            )
        dist.barrier()
        if rank == 0:
            shutil.rmtree(out)
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]} if runs else {}


def writers_main(args, argv: list[str] | None) -> int:
    """The per-node-writer mode: one world, writers 1 -> 8."""
    world, rows, t_all = args.worlds[0], [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tdgather-writers-") as scratch:
        for writers in args.writers:
            k = None if writers == 1 else world // writers
            r = run_local_world(
                writers_rank, world, k, args.mb, args.repeats, scratch, args.timeout, timeout=args.timeout
            )
            rows.append({"writers": writers, "k": k or world, **r[0]})
            x = r[0]
            print(
                f"{writers} writers: rank 0 received {x['received'] / 1e6:.0f} MB, wrote {x['written'] / 1e6:.0f} MB, "
                f"{x['seconds']:.3f} s (slowest rank {x['slowest']:.3f} s, close {x['close']:.3f} s, "
                f"of which the index over all writers {x['combine']:.3f} s)",
                flush=True,
            )
    command = "python -m benchmarks.scaling " + shlex.join(argv if argv is not None else sys.argv[1:])
    if not args.no_report:
        print(
            f"report: {write_writers_report(rows, Path(args.out), command, args, world, time.perf_counter() - t_all)}"
        )
    return 0


def write_writers_report(rows: list[dict], out_dir: Path, command: str, args, world: int, seconds: float) -> Path:
    """A markdown table: rank 0's bytes and time per writer count, against one writer."""
    m = machine()
    date = _dt.date.today().isoformat()
    one = rows[0]
    lines = [
        f"# tdgather: one writer per block of ranks, {date}, {m['label']}",
        "",
        f"- command: `{command}` ({args.repeats} timed runs after one warm-up, medians; {seconds:.0f} s in all)",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram']}; {m['os']}",
        f"- versions: Python {m['python']}, torch {m['torch']}, tensordict {m['tensordict']}",
        f"- workload: {world} ranks, {args.mb:g} MB of 3x32x32 float32 frames each, videos of 40 frames dealt"
        " round-robin over all ranks (so every video spans several writers, and the coordinator merges their"
        " segments at close)",
        "- rank 0 received: frame bytes from other ranks; rank 0 wrote: its shard files; largest writer: the most"
        " any writer wrote. With one writer per block of k ranks, rank 0 receives from its own block only.",
        "- seconds: rank 0's wall time from a barrier to the end of close(); slowest rank: the job's; close: rank"
        " 0's close(); combining writers: the part of it that reads every writer's shard records, resolves"
        " copies across writers and merges their segments (before the index is written).",
        f"- all {world} processes share the machine's cores and one disk: wall times measure CPU contention, not"
        " links. The bytes are what each link and disk would carry on separate nodes.",
        "",
        "| writers | ranks per writer | rank 0 received MB | vs 1 writer | rank 0 wrote MB | vs 1 writer |"
        " largest writer MB | rank 0 s | slowest rank s | rank 0 close s | of it, combining writers s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            str(r["writers"]),
            str(r["k"]),
            f"{r['received'] / 1e6:.1f}",
            f"{r['received'] / one['received']:.3f}" if one["received"] else "—",
            f"{r['written'] / 1e6:.1f}",
            f"{r['written'] / one['written']:.3f}" if one["written"] else "—",
            f"{r['largest'] / 1e6:.1f}",
            f"{r['seconds']:.3f}",
            f"{r['slowest']:.3f}",
            f"{r['close']:.3f}",
            f"{r['combine']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return _write(out_dir / f"{date}-{m['label']}-writers.md", lines)


def _write(md: Path, lines: list[str]) -> Path:
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines) + "\n")
    return md


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", help="world sizes (default 2 4 8 16 32; 16 with --writers)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=DEFAULT_METHODS)
    parser.add_argument("--mb", type=float, default=4.0, help="MB of frames per rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--no-report", action="store_true")
    parser.add_argument("--writers", type=int, nargs="+", help="the per-node-writer mode: these writer counts")
    args = parser.parse_args(argv)
    args.worlds = args.worlds or ([16] if args.writers else [2, 4, 8, 16, 32])
    if args.writers:
        if any(args.worlds[0] % w for w in args.writers):
            parser.error(f"--writers: each must divide the world size {args.worlds[0]}")
        return writers_main(args, argv)
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
    return _write(out_dir / f"{date}-{m['label']}-scaling.md", lines)


if __name__ == "__main__":
    sys.exit(main())
