"""What bounding the loss window costs: a paced loop of small outputs, with and without time-based commits.

Run: ``python -m benchmarks.loss_window --seconds 8 --world 2``

Every rank adds a batch of 4 frames of 1 KB (float32[256]) every 20 ms for ``--seconds`` seconds
(embeddings, detections: a long job with small outputs), into a Collector with ``commit_every`` of
the default (300 s: nothing is written before close in so short a loop) and of 1 s (rank 0 writes a
shard every second, senders send every 0.25 s). Reported per setting: the median over
``--repeats`` runs of the time from the last ``add()`` to ``close()`` returning on rank 0, rank 0's
CPU seconds (its process time, all threads) over the run, the shards written, and, as a ratio
against the default in the same run, rank 0's CPU time: the cost of the bound.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.launch import run_local_world

BATCH, FRAME = 4, 256


def _rank(out: str, seconds: float, commit_every: float) -> dict:
    rank = dist.get_rank()
    cpu0 = time.process_time()
    added, end = 0, time.monotonic() + seconds
    with tdgather.Collector(out, commit_every=commit_every, timeout=120, progress=False, overwrite=True) as col:
        while time.monotonic() < end:
            col.add([f"r{rank}.mp4"] * BATCH, list(range(added, added + BATCH)), torch.rand(BATCH, FRAME))
            added += BATCH
            time.sleep(0.02)
        last_add = time.perf_counter()
    close = time.perf_counter() - last_add
    summary = col.summary
    return {
        "close": close,
        "cpu": time.process_time() - cpu0,
        "shards": summary.shards if summary else None,
        "frames": summary.frames if summary else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    rows = {}
    for every in (300.0, 1.0):
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(run_local_world(_rank, args.world, f"{tmp}/ds", args.seconds, every, timeout=600)[0])
        rows[every] = {k: statistics.median(r[k] for r in runs) for k in ("close", "cpu", "shards", "frames")}
    base = rows[300.0]["cpu"]
    print(f"{args.world} ranks, {args.seconds:g} s loop, batches of {BATCH} x float32[{FRAME}] every 20 ms")
    print("| commit_every | frames | shards | close (s) | rank 0 CPU (s) | CPU vs default |")
    print("|---|---|---|---|---|---|")
    for every, r in rows.items():
        print(
            f"| {every:g} | {r['frames']:.0f} | {r['shards']:.0f} | {r['close']:.3f} | {r['cpu']:.2f} "
            f"| {r['cpu'] / base:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
