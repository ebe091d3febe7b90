"""Reading the output back: the README loop and the DataLoader recipe, against a pickle dump and one .npy per frame.

Run: ``python -m benchmarks.readback --repeats 3``

Two workloads, each written once by a `tdgather.Collector` at ``--world`` ranks (a local gloo
world), with its alternative written in the same world. Then every method is timed in turn,
one round after another (the order rotates each round), ``--repeats`` rounds after a warm-up
round; the page cache stays warm (every method reads bytes it has read before).

(a) prompts: ``--prompts`` prompts of a captioner, one frame each, ``{"tokens": int64[N_i], "text": str}``
(tokens ``1..N_i``, N_i in 1..500, ragged; the text a JSON leaf), added in batches of 64 per rank.

- ``readme_loop``: README's loop, ``ds = tdgather.open(path)``, ``for name in ds: clip = ds[name]``,
  then each frame ``clip.frames[k]``'s ``["tokens"]`` and ``["text"]``;
- ``readme_columns``: the same loop taking the columns ``clip.frames["tokens"]`` (a nested tensor)
  and ``clip.frames["text"]`` instead of each frame;
- ``torch_load``: ``torch.load`` (``weights_only=True``, torch's default) of what ``gather_object``
  gave rank 0 in the same world (every rank's ``{prompt: (0, {"tokens", "text"})}`` merged into one
  dict and ``torch.save``-d), then each prompt's tokens and text;
- ``torch_load_pickle``: the same with ``weights_only=False`` (plain pickle).

(b) frames: ``--frames`` frames of ``float32[256]`` in ``--filenames`` filenames (frames per
filename equal), added in batches of 64 per rank.

- ``loader``: docs/reading.md's recipe, ``DataLoader(ds.per_frame(), batch_size=64, shuffle=True,
  num_workers=2, collate_fn=tdgather.collate_frames)``, one epoch (the open, ``per_frame()`` and
  the workers' start included);
- ``npy_loader``: one ``.npy`` file per frame (written by each rank), a plain map-style Dataset
  (``np.load`` per item, ``{"filename", "frame_idx", "frames"}``) in a DataLoader of the same
  settings and torch's default collate (the listing of the files included);
- ``loader_in_process``: the recipe with ``num_workers=0``;
- ``per_frame``: ``ds.per_frame()`` item by item in this process, in a shuffled order;
- ``npy_items``: the ``.npy`` Dataset item by item in this process, in a shuffled order.

Reported: seconds (median, and the range over the repeats), items/s (prompts or frames), and
each method against the alternative in the same run (``torch_load``, ``npy_loader``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import tdgather
from tdgather.tools.launch import run_local_world

from .report import machine

BATCH = 64


def _write_prompts(prompts: int, out: str) -> None:
    """Every rank: its prompts (round-robin) to a Collector; and the same dict through ``gather_object`` to a dump."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 501, (prompts,), generator=g).tolist()
    mine = [p for p in range(prompts) if p % world == rank]
    with tdgather.Collector(f"{out}/prompts", dst=0, overwrite=True, timeout=600) as col:
        for b in range(0, len(mine), BATCH):
            ps = mine[b : b + BATCH]
            tokens = torch.nested.as_nested_tensor([torch.arange(1, lengths[p] + 1) for p in ps], layout=torch.jagged)
            text = [f"a caption of prompt {p}, {lengths[p]} tokens" for p in ps]
            col.add(
                [f"prompt_{p:05d}" for p in ps],
                torch.zeros(len(ps), dtype=torch.int64),
                {"tokens": tokens, "text": text},
            )
    dump = {
        f"prompt_{p:05d}": (
            0,
            {"tokens": torch.arange(1, lengths[p] + 1), "text": f"a caption of prompt {p}, {lengths[p]} tokens"},
        )
        for p in mine
    }
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(dump, gathered, dst=0)
    if rank == 0:
        merged = {k: v for d in gathered for k, v in d.items()}
        torch.save(merged, f"{out}/prompts.pt")


def _frame(f: int, t: int) -> torch.Tensor:
    return torch.rand(256, generator=torch.Generator().manual_seed(f * 1000 + t))


def _write_frames(frames: int, filenames: int, out: str) -> None:
    """Every rank: its filenames' frames (round-robin by filename) to a Collector, and one .npy file per frame."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = frames // filenames
    pairs = [(f, t) for f in range(rank, filenames, world) for t in range(per)]
    npy = Path(out) / "npy"
    npy.mkdir(parents=True, exist_ok=True)
    with tdgather.Collector(f"{out}/frames", dst=0, overwrite=True, timeout=600) as col:
        for b in range(0, len(pairs), BATCH):
            batch = pairs[b : b + BATCH]
            values = torch.stack([_frame(f, t) for f, t in batch])
            col.add([f"clip_{f:05d}.mp4" for f, _ in batch], torch.tensor([t for _, t in batch]), values)
            for (f, t), v in zip(batch, values, strict=True):
                np.save(npy / f"clip_{f:05d}.mp4.{t}.npy", v.numpy())


class NpyFrames(Dataset):
    """One ``.npy`` file per frame, ``<filename>.<frame_idx>.npy``: the plain alternative."""

    def __init__(self, root: Path) -> None:
        self.files = sorted(os.listdir(root))
        self.root = root

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        name = self.files[i]
        filename, frame_idx, _ = name.rsplit(".", 2)
        return {
            "filename": filename,
            "frame_idx": int(frame_idx),
            "frames": torch.from_numpy(np.load(self.root / name)),
        }


def _readme_loop(out: Path) -> int:
    ds = tdgather.open(out / "prompts")
    n = 0
    for name in ds:
        clip = ds[name]
        for k in range(len(clip)):
            frame = clip.frames[k]
            frame["tokens"], frame["text"]
            n += 1
    return n


def _readme_columns(out: Path) -> int:
    ds = tdgather.open(out / "prompts")
    n = 0
    for name in ds:
        clip = ds[name]
        clip.frames["tokens"], clip.frames["text"]
        n += len(clip)
    return n


def _torch_load(out: Path, weights_only: bool = True) -> int:
    dump = torch.load(out / "prompts.pt", weights_only=weights_only)
    n = 0
    for _name, (_idx, value) in dump.items():
        value["tokens"], value["text"]
        n += 1
    return n


def _torch_load_pickle(out: Path) -> int:
    return _torch_load(out, weights_only=False)


def _count(loader: DataLoader) -> int:
    return sum(len(batch["filename"]) for batch in loader)


def _loader(out: Path, workers: int = 2) -> int:
    frames = tdgather.open(out / "frames").per_frame()
    return _count(
        DataLoader(frames, batch_size=BATCH, shuffle=True, num_workers=workers, collate_fn=tdgather.collate_frames)
    )


def _loader_in_process(out: Path) -> int:
    return _loader(out, 0)


def _npy_loader(out: Path) -> int:
    return _count(DataLoader(NpyFrames(out / "npy"), batch_size=BATCH, shuffle=True, num_workers=2))


def _per_frame(out: Path) -> int:
    frames = tdgather.open(out / "frames").per_frame()
    for i in torch.randperm(len(frames)).tolist():
        frames[i]
    return len(frames)


def _npy_items(out: Path) -> int:
    frames = NpyFrames(out / "npy")
    for i in torch.randperm(len(frames)).tolist():
        frames[i]
    return len(frames)


WORKLOADS = {
    "prompts": {
        "readme_loop": _readme_loop,
        "readme_columns": _readme_columns,
        "torch_load": _torch_load,
        "torch_load_pickle": _torch_load_pickle,
    },
    "frames": {
        "loader": _loader,
        "npy_loader": _npy_loader,
        "loader_in_process": _loader_in_process,
        "per_frame": _per_frame,
        "npy_items": _npy_items,
    },
}
BASELINE = {"prompts": "torch_load", "frames": "npy_loader"}


def _check(out: Path) -> None:
    """Untimed: both sides hold the same values (a benchmark of wrong answers is worth nothing)."""
    ds, dump = tdgather.open(out / "prompts"), torch.load(out / "prompts.pt")
    assert sorted(ds) == sorted(dump)
    for name in list(ds)[:: max(1, len(ds) // 200)]:
        frame = ds[name].frames[0]
        assert torch.equal(frame["tokens"], dump[name][1]["tokens"]) and frame["text"] == dump[name][1]["text"]
    frames, npy = tdgather.open(out / "frames").per_frame(), NpyFrames(out / "npy")
    assert len(frames) == len(npy)
    loader = DataLoader(frames, batch_size=BATCH, num_workers=0, collate_fn=tdgather.collate_frames)
    batch = next(iter(loader))
    for k in range(BATCH):
        name, t = batch["filename"][k], int(batch["frame_idx"][k])
        assert torch.equal(batch["frames"][k], torch.from_numpy(np.load(out / "npy" / f"{name}.{t}.npy")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10_000)
    parser.add_argument("--frames", type=int, default=50_000)
    parser.add_argument("--filenames", type=int, default=10_000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--out", help="write the datasets here (kept) instead of a temporary directory")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="tdgather-readback-"))
    methods = {m: fn for w in args.workloads for m, fn in WORKLOADS[w].items()}
    workload_of = {m: w for w in args.workloads for m in WORKLOADS[w]}
    try:
        t0 = time.perf_counter()
        if "prompts" in args.workloads:
            run_local_world(_write_prompts, args.world, args.prompts, str(out), timeout=1800)
        if "frames" in args.workloads:
            run_local_world(_write_frames, args.world, args.frames, args.filenames, str(out), timeout=1800)
        written = time.perf_counter() - t0
        if set(args.workloads) == set(WORKLOADS):
            _check(out)
        times: dict[str, list[float]] = {m: [] for m in methods}
        items: dict[str, int] = {}
        order = list(methods)
        for r in range(args.repeats + 1):  # the first round warms the page cache, the imports and the forks
            for m in order[r % len(order) :] + order[: r % len(order)]:
                t0 = time.perf_counter()
                items[m] = methods[m](out)
                if r:
                    times[m].append(time.perf_counter() - t0)
            print(f"round {r}: " + ", ".join(f"{m} {times[m][-1]:.2f} s" for m in order if r and times[m]), flush=True)
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    m = machine()
    print()
    print(f"- command: `python -m benchmarks.readback {' '.join(argv if argv is not None else sys.argv[1:])}`")
    print(f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram']}; {m['os']}")
    print(f"- versions: Python {m['python']}, torch {m['torch']}, tensordict {m['tensordict']}, numpy {np.__version__}")
    print(f"- written by a Collector at {args.world} ranks in {written:.1f} s; median of {args.repeats} rounds")
    print()
    print("| workload | method | items | seconds (median) | seconds (range) | items/s | x alternative |")
    print("|---|---|---|---|---|---|---|")
    for meth, ts in times.items():
        w = workload_of[meth]
        s = statistics.median(ts)
        base = statistics.median(times[BASELINE[w]])
        ratio = f"{s / base:.2f}x the time" if w == "prompts" else f"{base / s:.2f}x the rate"
        spread = f"{min(ts):.3f}-{max(ts):.3f}"
        print(f"| {w} | {meth} | {items[meth]} | {s:.3f} | {spread} | {items[meth] / s:,.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
