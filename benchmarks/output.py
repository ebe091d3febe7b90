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

Many filenames: ``python -m benchmarks.output --filenames 2000 20000 100000 [--many-methods ...]``

One filename per image (an embedding job): ``n`` filenames of one frame ``float32[16]`` each, saved
once per ``n``. Timed, each on a fresh ``tdgather.open(path)`` (page cache warm):

- ``open``: ``tdgather.open(path)`` (the index parsed and checked);
- ``read``: ``ds[name]`` for ``--reads`` filenames spread over the dataset, on a fresh handle
  (the first read checks the shard's header): ms per read (median of ``--repeats``);
- ``per_frame``: ``ds.per_frame()`` built (seconds), and ``per_frame_item``: ms per item read;
- ``to_hf``: ``ds.to_hf()`` (seconds; needs ``datasets``).

Every figure should stay flat as ``n`` grows, except what reads every frame (``per_frame``,
``to_hf``), which should grow linearly.
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
from tdgather.storage.views import collate_frames


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


def make_many(path: Path, n: int) -> None:
    """Save ``n`` filenames of one frame ``float32[16]`` each."""
    g = torch.Generator().manual_seed(0)
    tdgather.save(tdgather.gather({f"img_{i:06d}.jpg": (0, torch.rand(16, generator=g)) for i in range(n)}), path)


def _spread(items: list, k: int) -> list:
    return items[:: max(1, len(items) // k)][:k]


def _many(path: Path, n: int, methods: list[str], reads: int) -> dict[str, float]:
    """One round of the many-filenames figures, each on a fresh handle."""
    out = {}
    t0 = time.perf_counter()
    ds = tdgather.open(path)
    out["open"] = time.perf_counter() - t0
    names = _spread(sorted(ds), reads)
    if "read" in methods:
        t0 = time.perf_counter()
        for name in names:
            ds[name]
        out["read"] = (time.perf_counter() - t0) / len(names) * 1e3
    if "per_frame" in methods:
        ds = tdgather.open(path)
        t0 = time.perf_counter()
        frames = ds.per_frame()
        out["per_frame"] = time.perf_counter() - t0
        items = _spread(list(range(len(frames))), reads)
        t0 = time.perf_counter()
        for i in items:
            frames[i]
        out["per_frame_item"] = (time.perf_counter() - t0) / len(items) * 1e3
    if "to_hf" in methods:
        import datasets

        datasets.disable_progress_bars()
        ds = tdgather.open(path)
        t0 = time.perf_counter()
        hf = ds.to_hf()
        out["to_hf"] = time.perf_counter() - t0
        assert len(hf) == n
    return out


MANY = {"open": "s", "read": "ms/read", "per_frame": "s", "per_frame_item": "ms/item", "to_hf": "s"}


def many_main(args: argparse.Namespace) -> None:
    rows = []
    for n in args.filenames:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ds"
            make_many(path, n)
            rounds = [_many(path, n, args.many_methods, args.reads) for _ in range(args.repeats + 1)]
        figures = {k: statistics.median(r[k] for r in rounds[1:]) for k in rounds[0]}
        rows.append((n, figures))
        print(f"{n} filenames: " + ", ".join(f"{k} {v:.4g} {MANY[k]}" for k, v in figures.items()), flush=True)
    print(
        f"{platform.machine()}, torch {torch.__version__}, one frame float32[16] per filename, "
        f"{args.reads} reads spread over the filenames, median of {args.repeats} after a warm-up round"
    )
    keys = list(rows[0][1])
    print("| filenames | " + " | ".join(f"{k} ({MANY[k]})" for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for n, figures in rows:
        print(f"| {n} | " + " | ".join(f"{figures[k]:.4g}" for k in keys) + " |")


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
    parser.add_argument("--filenames", type=int, nargs="+", help="instead: the many-filenames figures, per count")
    parser.add_argument(
        "--many-methods", nargs="+", choices=["read", "per_frame", "to_hf"], default=["read", "per_frame", "to_hf"]
    )
    parser.add_argument("--reads", type=int, default=1000, help="filenames (items) read per round, with --filenames")
    args = parser.parse_args()
    if args.filenames:
        many_main(args)
        return
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
