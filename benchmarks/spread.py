"""What a writer per rank costs a reader: videos a frame-level sampler spread over every rank.

Run: ``python -m benchmarks.spread --world 4 --videos 2000 --frames 64 --repeats 5``

Each rank of a local world takes every W-th (video, frame) of the flattened list (what a
`DistributedSampler` without shuffling gives), so every video has frames on every rank, and adds
them to a `tdgather.Collector` in batches of 64 (``float32[256]`` a frame). The same frames are
written twice: with one writer (the default: rank 0 writes every shard, each video one segment a
shard) and with ``ranks_per_writer=1`` (every rank writes its own shards, so each video has a
segment per rank). Then, in this process, for each dataset: ``tdgather.open`` (the index read and
checked), and reading every video's frames (``ds[name].frames``, merged by frame_idx from its
segments), each the median of ``--repeats`` with a warm page cache; and the close, the slowest
rank's seconds from a barrier to the end of the ``with`` block, in the world.

The writer per rank is what reaches the disk's speed on one host (`benchmarks.host`); this is
what it costs whoever reads a dataset whose filenames were spread over the ranks. A job that
gives each rank whole videos, or one frame per filename, leaves one segment a filename either way.
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

import tdgather
from tdgather.tools.launch import run_local_world

BATCH = 64


def _write(out: str, videos: int, frames: int, writers: int | None) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = [(v, f) for v in range(videos) for f in range(frames)]
    mine = flat[rank::world]
    outputs = [torch.randn(len(mine[i : i + BATCH]), 256) for i in range(0, len(mine), BATCH)]  # before the clock
    dist.barrier()
    start = time.perf_counter()
    with tdgather.Collector(out, progress=False, log_summary=False, ranks_per_writer=writers) as col:
        for i, batch in zip(range(0, len(mine), BATCH), outputs, strict=True):
            pairs = mine[i : i + BATCH]
            col.add([f"video_{v:05d}.mp4" for v, _ in pairs], torch.tensor([f for _, f in pairs]), batch)
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _read(out: str) -> tuple[float, float, int, int]:
    """Seconds to open, seconds to read every video's frames, frames read, segments in the index."""
    start = time.perf_counter()
    ds = tdgather.open(out)
    opened = time.perf_counter() - start
    start = time.perf_counter()
    n = sum(ds[name].frames.shape[0] for name in ds)
    read = time.perf_counter() - start
    with open(os.path.join(out, "tdgather.index.json")) as fh:
        segments = sum(len(entry["segments"]) for entry in json.load(fh)["files"].values())
    return opened, read, n, segments


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spread", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--videos", type=int, default=2000)
    parser.add_argument("--frames", type=int, default=64, help="frames a video")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="tdgather-spread-") as tmp:
        for label, writers in (("one writer", None), ("ranks_per_writer=1", 1)):
            out = os.path.join(tmp, f"w{writers}")
            close = run_local_world(_write, args.world, out, args.videos, args.frames, writers, timeout=1800)[0]
            _read(out)  # a warm-up: the page cache and the imports
            runs = [_read(out) for _ in range(args.repeats)]
            shards = sum(f.endswith(".safetensors") for f in os.listdir(out))
            rows[label] = (close, *(statistics.median(r[k] for r in runs) for k in range(2)), *runs[0][2:], shards)
    print(
        f"{args.videos} videos x {args.frames} frames of float32[256], each spread over {args.world} ranks; "
        f"median of {args.repeats} reads"
    )
    print("| writers | close s | open s | read every video s | frames | segments | shards |")
    print("|---|---|---|---|---|---|---|")
    for label, (close, opened, read, n, segments, shards) in rows.items():
        print(f"| {label} | {close:.3f} | {opened:.4f} | {read:.3f} | {n} | {segments} | {shards} |")
    one, each = rows["one writer"], rows["ranks_per_writer=1"]
    print(
        f"a writer per rank: close {each[0] / one[0]:.2f}x, open {each[1] / one[1]:.2f}x, "
        f"reading every video {each[2] / one[2]:.2f}x the one writer's"
    )


if __name__ == "__main__":
    main()
