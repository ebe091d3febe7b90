"""A detection workload (0-50 boxes per frame, and an embedding): tdgather against what users do today.

Run: ``python -m benchmarks.detection --world 2 --videos 200 --repeats 3``
(``--dense-first``: the first half of the videos has 25 boxes in every frame, see below)

Per frame: ``boxes`` float32 ``[N_i, 4]``, ``scores`` float32 ``[N_i]``, ``labels`` int64 ``[N_i]``
with N_i uniform in 0..50, and ``feat`` float32 ``[256]``; ``--videos`` videos of 100 frames, dealt
round-robin to the ranks, in batches of 32 (jagged nested tensors, as a detector's head gives).
Methods, each timed on rank 0 from a barrier to its result, median of ``--repeats``:

- ``tdgather_gather``: `tdgather.gather` of a `FrameStore` filled before the timing (no padding);
- ``tdgather_store``: the store filled batch by batch (``add``), then gathered: the whole job;
- ``tdgather_collector``: a `Collector` through the loop, writing and fsyncing the dataset;
- ``pad_all_gather``: every ragged leaf padded to the largest N_i anywhere (all_reduce MAX), the
  frame counts padded to the largest rank's, then all_gather of each leaf, the lengths and the
  frame ids (accelerate's pad_across_processes + gather, torchmetrics' gather_all_tensors);
- ``gather_object``: `torch.distributed.gather_object` of the rank's ``[(filename, frame_idx,
  {leaf: tensor})]`` (pickled);
- ``tdgather_dict``: `tdgather.gather` of the seed's form, ``{video: [(frame_idx, {"boxes", "scores",
  "labels", "feat"}), ...]}``, each frame's tensors its own (as a detector's per-image dicts are),
  built before the timing, with ``ragged=("boxes", "scores", "labels")``;
  ``tdgather_dict_undeclared``: the same without ``ragged=`` (each box count a layout, made ragged
  where a video's counts differ);
- ``tdgather_undeclared``, ``tdgather_collector_undeclared``: as ``tdgather_gather`` (a store filled
  before the timing) and
  ``tdgather_collector``, but each batch as a model with no ragged declaration gives it: where every
  frame of the batch has the same count, dense tensors ``[B, n, 4]`` (stored fixed), else jagged.
  With ``--dense-first`` a video's frames are split over ranks with 25 boxes each, so no rank ever
  sees a count vary within a video of the first half, and rank dst makes the leaves ragged (in
  `gather`, by merging once every frame has come instead of receiving into place): the cost of
  finding the leaves ragged late, against the declared (jagged) runs above.

Also reported: bytes each method puts on the wire against the frame bytes (tdgather: preludes,
headers, frame index and pieces, from `tdgather.comm.pack`; padding: the padded tensors; pickle: the
pickled payload), and rank 0's peak resident data (anonymous memory) above its baseline.
"""

from __future__ import annotations

import argparse
import pickle
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import tdgather
from tdgather.comm.pack import pack
from tdgather.comm.wire import PRELUDE_LEN, encode_json
from tdgather.core.ragged import Ragged
from tdgather.tools.launch import run_local_world

from .memory import PeakSampler

LEAVES = {"boxes": (torch.float32, (4,)), "scores": (torch.float32, ()), "labels": (torch.int64, ())}
FEAT = 256
PER_VIDEO = 100
BATCH = 32


def batches(
    videos: int, rank: int, world: int, seed: int = 0, dense_first: bool = False
) -> list[tuple[list[str], torch.Tensor, dict]]:
    """Rank ``rank``'s batches: ``(filenames, frame_idx, {boxes, scores, labels: nested; feat})``."""
    g = torch.Generator().manual_seed(seed)
    total = videos * PER_VIDEO
    lengths = torch.randint(0, 51, (total,), generator=g)
    if dense_first:  # the first half of the videos: 25 boxes in every frame
        lengths[: (videos // 2) * PER_VIDEO] = 25
    mine = torch.arange(rank, total, world)
    out = []
    for lo in range(0, mine.numel(), BATCH):
        frames = mine[lo : lo + BATCH]
        n = lengths[frames]
        rows = int(n.sum())
        value = {
            k: Ragged.from_lengths(_values(dt, (rows, *shape), g), n).to_nested() for k, (dt, shape) in LEAVES.items()
        }
        value["feat"] = torch.rand(frames.numel(), FEAT, generator=g)
        out.append(([f"video_{int(f) // PER_VIDEO:04d}.mp4" for f in frames], frames % PER_VIDEO, value))
    return out


def _values(dtype: torch.dtype, shape: tuple, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 80, shape, generator=g) if dtype == torch.int64 else torch.rand(shape, generator=g) * 640


def frame_bytes(data: list) -> int:
    """The frames' own bytes: every box, score, label and embedding, nothing else."""
    total = 0
    for _, _, value in data:
        total += sum(v.values().numel() * v.values().element_size() for k, v in value.items() if k != "feat")
        total += value["feat"].numel() * 4
    return total


def _store(data: list, copy: bool = True) -> tdgather.FrameStore:
    store = tdgather.FrameStore(copy=copy)
    for names, idx, value in data:
        store.add(names, idx, value)
    return store


def undeclared(data: list) -> list:
    """The batches as a model gives them with no ragged declaration: dense ``[B, n, ...]`` where every count is n."""
    out = []
    for names, idx, value in data:
        n = value["boxes"].offsets().diff()
        if n.numel() and bool((n == n[0]).all()):
            b = n.numel()
            value = {
                k: (v if k == "feat" else v.values().view(b, int(n[0]), *v.values().shape[1:]))
                for k, v in value.items()
            }
        out.append((names, idx, value))
    return out


def tdgather_undeclared(data: list, ctx: dict) -> None:
    tdgather.gather(ctx["undeclared_store"], timeout=600)


def tdgather_collector_undeclared(data: list, ctx: dict) -> None:
    tdgather_collector(ctx["undeclared"], ctx)


def tdgather_wire_bytes(data: list, store: tdgather.FrameStore | None = None) -> int:
    """What tdgather sends for these frames (or for ``store``, holding them): preludes, headers, the frame
    index and the pieces."""
    done = 8 * PRELUDE_LEN + len(encode_json({"frames": sum(len(n) for n, _, _ in data)}))
    if not data:
        return done
    packed = pack(store or _store(data))
    pieces = sum(t.nbytes for piece in packed.pieces for t in piece)
    return (
        done
        + 8 * PRELUDE_LEN * (1 + len(packed.pieces))
        + len(encode_json(packed.header))
        + packed.index.numel()
        + pieces
    )


def tdgather_gather(data: list, ctx: dict) -> None:
    tdgather.gather(ctx["store"], timeout=600)


def tdgather_store(data: list, ctx: dict) -> None:
    tdgather.gather(_store(data), timeout=600)


def seed_dict(data: list) -> dict:
    """The seed's form: ``{video: [(frame_idx, {"boxes", "scores", "labels", "feat"}), ...]}``, a tensor each."""
    out: dict = {}
    for name, i, frame in _as_objects(data):
        out.setdefault(name, []).append((i, frame))
    return out


def tdgather_dict(data: list, ctx: dict) -> None:
    tdgather.gather(ctx["dict"], ragged=tuple(LEAVES), timeout=600)


def tdgather_dict_undeclared(data: list, ctx: dict) -> None:
    tdgather.gather(ctx["dict"], timeout=600)


def tdgather_collector(data: list, ctx: dict) -> None:
    ctx["calls"] = ctx.get("calls", 0) + 1
    path = f"{ctx['scratch']}/det-{ctx['calls']}"
    with tdgather.Collector(path, timeout=600, progress=False) as col:
        for names, idx, value in data:
            col.add(names, idx, value)
    if dist.get_rank() == 0:
        shutil.rmtree(path)  # untimed in spirit: the next call writes into recycled pages, as a real job does


def pad_all_gather(data: list, ctx: dict) -> None:
    world = dist.get_world_size()
    n = sum(len(names) for names, _, _ in data)
    lengths = (
        torch.cat([v["boxes"].offsets().diff() for _, _, v in data]) if data else torch.zeros(0, dtype=torch.int64)
    )
    most = torch.tensor([int(lengths.max()) if n else 0, n])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the largest N_i anywhere, the largest rank
    width, rows = int(most[0]), int(most[1])
    sent = 0
    leaves = {}
    for key, (dtype, shape) in LEAVES.items():
        padded = torch.zeros((rows, width, *shape), dtype=dtype)
        for lo, (_, _, v) in zip(_starts(data), data, strict=True):
            p, _ = tdgather.padded(v[key])
            padded[lo : lo + p.shape[0], : p.shape[1]] = p
        leaves[key] = padded
    leaves["feat"] = torch.zeros((rows, FEAT))
    leaves["feat"][:n] = torch.cat([v["feat"] for _, _, v in data]) if data else leaves["feat"][:0]
    ids = torch.full((rows, 3), -1, dtype=torch.int64)  # video, frame_idx, N_i
    if n:
        video = torch.tensor([int(name[6:10]) for names, _, _ in data for name in names])
        ids[:n] = torch.stack([video, torch.cat([i for _, i, _ in data]), lengths], 1)
    leaves["ids"] = ids
    for t in leaves.values():
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)
        sent += t.numel() * t.element_size()
    ctx["wire"] = sent


def _starts(data: list) -> list[int]:
    out, at = [], 0
    for names, _, _ in data:
        out.append(at)
        at += len(names)
    return out


def _as_objects(data: list) -> list:
    """Per frame ``(filename, frame_idx, {leaf: tensor})``, each tensor its own (as a detector's per-image
    dicts are): pickling a view would pickle the whole batch it views."""
    return [
        (name, int(i), {k: v[k][j].clone() for k in (*LEAVES, "feat")})
        for names, idx, v in data
        for j, (name, i) in enumerate(zip(names, idx.tolist(), strict=True))
    ]


def gather_object(data: list, ctx: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    objects = _as_objects(data)
    out = [None] * world if rank == 0 else None
    dist.gather_object(objects, out, dst=0)


def _return_freed_memory() -> None:
    """glibc: large buffers (>= 256 KiB) mmapped and unmapped when freed, so each method's peak starts
    from what is alive, not from pages an earlier method left on the heap."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 256 << 10)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


METHODS = {
    "tdgather_gather": tdgather_gather,
    "tdgather_store": tdgather_store,
    "tdgather_collector": tdgather_collector,
    "pad_all_gather": pad_all_gather,
    "gather_object": gather_object,
    "tdgather_undeclared": tdgather_undeclared,
    "tdgather_collector_undeclared": tdgather_collector_undeclared,
    "tdgather_dict": tdgather_dict,
    "tdgather_dict_undeclared": tdgather_dict_undeclared,
}


def _rank(videos: int, methods: list[str], repeats: int, scratch: str, dense_first: bool = False) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    _return_freed_memory()
    data = batches(videos, rank, world, dense_first=dense_first)
    ctx = {"scratch": scratch, "store": _store(data, copy=False), "undeclared": undeclared(data)}
    ctx["undeclared_store"] = _store(ctx["undeclared"], copy=False)
    ctx["dict"] = seed_dict(data)
    dict_stores = [tdgather.FrameStore(copy=False) for _ in range(2)]  # what the dict is sent as
    dict_stores[0].update(ctx["dict"], ragged=tuple(LEAVES))
    dict_stores[1].update(ctx["dict"])
    sizes = [frame_bytes(data), tdgather_wire_bytes(data), len(pickle.dumps(_as_objects(data)))]
    sizes += [tdgather_wire_bytes(ctx["undeclared"]), *(tdgather_wire_bytes(data, s) for s in dict_stores)]
    sizes = torch.tensor(sizes)
    dist.all_reduce(sizes)
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, int] = {}
    padded_wire = 0
    for _ in range(repeats):
        for m in methods:
            dist.barrier()
            sampler = PeakSampler() if rank == 0 else None
            t0 = time.perf_counter()
            METHODS[m](data, ctx)
            seconds[m].append(time.perf_counter() - t0)
            if sampler is not None:
                peaks[m] = max(peaks.get(m, 0), sampler.close()["RssAnon"])
            if m == "pad_all_gather":
                wire = torch.tensor([ctx["wire"]])
                dist.all_reduce(wire)
                padded_wire = int(wire)
    if rank != 0:
        return None
    frames, wire, pickled, undeclared_wire, dict_wire, undeclared_dict_wire = (int(x) for x in sizes)
    wire_of = {"tdgather_gather": wire, "tdgather_store": wire, "tdgather_collector": wire}
    wire_of |= {"tdgather_dict": dict_wire, "tdgather_dict_undeclared": undeclared_dict_wire}
    wire_of |= {"pad_all_gather": padded_wire, "gather_object": pickled}
    wire_of |= {"tdgather_undeclared": undeclared_wire, "tdgather_collector_undeclared": undeclared_wire}
    return {
        "frame_bytes": frames,
        "rows": [(m, statistics.median(seconds[m]), wire_of[m], peaks[m]) for m in methods],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--videos", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--dense-first", action="store_true", help="25 boxes in every frame of the first half")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="tdgather-det-")
    try:
        fn, w, a = _rank, args.world, (args.videos, args.methods, args.repeats, scratch, args.dense_first)
        r = run_local_world(fn, w, *a, timeout=3000)[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    frames = r["frame_bytes"]
    base = dict((m, s) for m, s, _, _ in r["rows"]).get("tdgather_gather")
    boxes = "25 boxes (first half of the videos) or 0-50" if args.dense_first else "0-50 boxes"
    print(
        f"detection: {args.videos} videos x {PER_VIDEO} frames, {boxes} + 256 floats per frame, "
        f"{frames / 1e6:.1f} MB of frames, world {args.world}, median of {args.repeats}"
    )
    print("| method | seconds | vs tdgather_gather | wire bytes / frame bytes | rank 0 peak / frame bytes |")
    print("|---|---|---|---|---|")
    for m, s, wire, peak in r["rows"]:
        ratio = f"{s / base:.2f}x" if base else "-"
        print(f"| {m} | {s:.3f} | {ratio} | {wire / frames:.3f} | {peak / frames:.2f} |")


if __name__ == "__main__":
    main()
