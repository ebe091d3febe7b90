"""What rank dst's close costs with many writers: combining their shards into one index.

One process builds the shards W writers would leave in ``<out>.partial`` (V videos of F frames,
each video's frames dealt round-robin over the writers, so every video has a segment in every
writer's shard), then times `DatasetWriter.combine` (reading every shard's record, finding and
resolving copies across writers, checking the merged index) and ``commit`` (writing it). Time
per stage, from wrapping the stages' functions; the result is printed and written to
``benchmarks/results/<date>-<machine>-combine.md``.

Run ``python -m benchmarks.combine --help``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import tdgather
import tdgather.storage.scan as scan
import tdgather.storage.writer as sink
from tdgather.storage.writer import DatasetWriter

from .report import machine

STAGES = {"records": (sink, "from_shards"), "copies": (scan, "resolve"), "index check": (scan, "check_index")}


def _timed(seconds: dict[str, float]) -> None:
    for stage, (module, name) in STAGES.items():
        real = getattr(module, name)

        @functools.wraps(real)
        def wrapper(*a, _real=real, _stage=stage, **k):
            t = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                seconds[_stage] = seconds.get(_stage, 0.0) + time.perf_counter() - t

        setattr(module, name, wrapper)


def one_run(root: Path, writers: int, videos: int, frames: int) -> dict[str, float]:
    """Build the writers' shards under ``root``, then combine and commit; seconds per stage."""
    w0 = DatasetWriter(root, writer=0)
    parts = {}
    for w in range(writers):
        d = w0 if w == 0 else DatasetWriter(root, writer=w, joins=(w0.run, w0.attempt))
        idx = torch.arange(w, frames, writers)
        d.write(
            {
                f"video_{v:06d}.mp4": tdgather.Frames(
                    frame_idx=idx, frames=torch.rand(len(idx), 16), batch_size=[len(idx)]
                )
                for v in range(videos)
            }
        )
        if w:
            parts[w] = d.report()
    seconds: dict[str, float] = {}
    _timed(seconds)
    try:
        t = time.perf_counter()
        w0.combine(parts)
        seconds["combine"] = time.perf_counter() - t
        t = time.perf_counter()
        w0.commit()
        seconds["commit"] = time.perf_counter() - t
    finally:
        for module, name in STAGES.values():
            setattr(module, name, getattr(module, name).__wrapped__)
    seconds["records"] -= seconds.get("copies", 0.0) + seconds.get("index check", 0.0)  # its own part
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.combine", description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--videos", type=int, default=2000)
    parser.add_argument("--frames", type=int, default=40, help="frames per video")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    rows = []
    for writers in args.writers:
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="tdgather-combine-") as tmp:
                runs.append(one_run(Path(tmp) / "ds", writers, args.videos, args.frames))
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row["writers"], row["segments"] = writers, args.videos * min(writers, args.frames)
        rows.append(row)
        print(
            f"{writers} writers, {row['segments']} segments: combine {row['combine']:.3f} s "
            f"({1e6 * row['combine'] / row['segments']:.1f} us a segment: records {row['records']:.3f}, copies "
            f"{row['copies']:.3f}, index check {row['index check']:.3f}), commit {row['commit']:.3f} s",
            flush=True,
        )
    m = machine()
    command = "python -m benchmarks.combine " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"# tdgather: combining many writers' shards, {_dt.date.today().isoformat()}, {m['label']}",
        "",
        f"- command: `{command}` (median of {args.repeats})",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram']}; {m['os']}",
        f"- versions: Python {m['python']}, torch {m['torch']}, tensordict {m['tensordict']}",
        f"- workload: {args.videos} videos of {args.frames} frames (float32[16]), each dealt round-robin over the"
        " writers: a segment per video per writer",
        "- combine: rank dst's step before the index, per stage: records (read and check every shard's header and"
        " segment record), copies (find frames held by several writers, resolve them), index check (the merged"
        " index, checked as tdgather.open checks one); commit: write the index and publish",
        "",
        "| writers | segments | combine s | µs a segment | records s | copies s | index check s | commit s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['writers']} | {r['segments']} | {r['combine']:.3f} | {1e6 * r['combine'] / r['segments']:.1f} | "
            f"{r['records']:.3f} | {r['copies']:.3f} | {r['index check']:.3f} | {r['commit']:.3f} |"
        )
    md = Path(args.out) / f"{_dt.date.today().isoformat()}-{m['label']}-combine.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines) + "\n")
    print(f"report: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
