"""Reading a saved dataset: per filename, per frame, and the Hugging Face export, against safetensors' own read.

Run: ``python -m benchmarks.output --files 20 --frames 100 --repeats 3``

A dataset of ``files x frames`` frames ``{"feat": float32[3, 32, 32], "boxes": float32[N_i, 4]}``
(N_i in 0..20, ragged) is saved once. Timed, each from a cold start of the Python objects (the
page cache stays warm: every method reads the same bytes, and the first repeat warms it):

- ``read_bytes``: every shard file read into memory, the physical baseline (all bytes, from the
  page cache, no checks, no per-filename work);
- ``open_all``: ``tdgather.open(path)[name]`` for every filename (index and headers checked);
- ``per_frame``: ``ds.per_frame()`` built, then every item read (each reads only its own rows);
- ``per_frame_loader``: the same through a ``DataLoader(num_workers=2, batch_size=64,
  collate_fn=collate_frames)``;
- ``to_hf``: ``ds.to_hf()`` (an in-memory ``datasets.Dataset``, one row a frame).

Reported: seconds (median), MB/s of frame bytes, and each method's time over ``read_bytes``'s.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import tdgather
from tdgather.views import collate_frames


def make(path: Path, files: int, frames: int) -> int:
    """Save the dataset; return its frame bytes."""
    g = torch.Generator().manual_seed(0)
    store = tdgather.FrameStore(copy=False)
    nbytes = 0
    for f in range(files):
        lengths = torch.randint(0, 21, (frames,), generator=g)
        boxes = torch.rand(int(lengths.sum()), 4, generator=g)
        feat = torch.rand(frames, 3, 32, 32, generator=g)
        nt = torch.nested.nested_tensor_from_jagged(
            boxes, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        )
        store.add(f"video_{f:04d}.mp4", torch.arange(frames), {"feat": feat, "boxes": nt})
        nbytes += feat.numel() * 4 + boxes.numel() * 4
    tdgather.save(tdgather.gather(store), path, max_shard_bytes=64 << 20)
    return nbytes


def _read_bytes(path: Path) -> None:
    for shard in sorted(path.glob("shard-*.safetensors")):
        shard.read_bytes()


def _open_all(path: Path) -> None:
    ds = tdgather.open(path)
    for name in ds:
        ds[name]


def _per_frame(path: Path) -> None:
    frames = tdgather.open(path).per_frame()
    for i in range(len(frames)):
        frames[i]


def _per_frame_loader(path: Path) -> None:
    loader = DataLoader(tdgather.open(path).per_frame(), batch_size=64, num_workers=2, collate_fn=collate_frames)
    for _ in loader:
        pass


def _to_hf(path: Path) -> None:
    tdgather.open(path).to_hf()


METHODS = {
    "read_bytes": _read_bytes,
    "open_all": _open_all,
    "per_frame": _per_frame,
    "per_frame_loader": _per_frame_loader,
    "to_hf": _to_hf,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ds"
        nbytes = make(path, args.files, args.frames)
        times = {m: [] for m in args.methods}
        for _ in range(args.repeats + 1):  # the first round warms the page cache and the imports
            for m in args.methods:
                t0 = time.perf_counter()
                METHODS[m](path)
                times[m].append(time.perf_counter() - t0)
    print(
        f"{platform.machine()}, torch {torch.__version__}, {args.files} files x {args.frames} frames, "
        f"{nbytes / 1e6:.1f} MB of frame bytes, median of {args.repeats} after a warm-up round"
    )
    base = statistics.median(times["read_bytes"][1:]) if "read_bytes" in times else None
    print("| method | seconds | MB/s | x read_bytes |")
    print("|---|---|---|---|")
    for m, ts in times.items():
        s = statistics.median(ts[1:])
        ratio = f"{s / base:.2f}" if base else ""
        print(f"| {m} | {s:.3f} | {nbytes / 1e6 / s:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
