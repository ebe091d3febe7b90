"""Where one call's time goes: per-stage wall time on every rank, by timers around tdgather's functions.

Run: ``python -m benchmarks.stages gather tiny --world 2`` (a workload of `benchmarks.workloads`, the
store filled before the timing as `tdgather_gather` does), ``python -m benchmarks.stages dict large
--world 4`` (`gather` of the workload as ``{filename: [(frame_idx, frame), ...]}``, each frame a
tensor of its own, as `tdgather_dict` does) or ``python -m benchmarks.stages collector 300 --world
2`` (every sender streams that many MB of 1 MiB frames to a Collector, as
`benchmarks.host` does; ``--pace`` seconds between batches of 32 MiB, as an inference loop spaces
them, so that rank dst keeps up: the ring of shared memory segments is then written again, and a
sender's ``ShmWriter.write`` shows what a chunk costs it; ``--ranks-per-writer 1``, every rank
writes its own shards) or ``python -m benchmarks.stages images 100000 --world 2`` (a Collector of that
many one-frame filenames of 1 KB, spread over the ranks, in batches of 500, as `benchmarks.many_files`
``--close`` times them). ``TDGATHER_SHM=0`` sends every byte over gloo; ``TDGATHER_SHM_RING=0``
writes every chunk into a new segment. A gather's result is freed after the clock stops, as
`benchmarks.suite` does.

For each stage (a library function, wrapped here before the first call): its total time in the
call, how many times it ran, and when it first started and last ended, in ms from the barrier
before the call; the median over ``--repeats`` calls after a warm-up. Stages overlap: they run on
several threads (rank dst's receive threads, a Collector's writer and fsync threads).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.launch import run_local_world

STAGES = {  # module: names (a "Class.method" is wrapped on its class)
    "tdgather.api.gather": ["begin_call", "post_ready", "ResultMemory.__init__"],
    "tdgather.api.send": ["pack", "send_frames"],
    "tdgather.api.receive": [
        "place",
        "read_pieces",
        "read_frames",
        "merge",
        "FrameStore.parts",
        "Receive._place",
        "Receive._land_local",
        "Receive._result",
        "Landing.finish",
    ],
    "tdgather.api.sending": ["pack", "send_frames"],
    "tdgather.api.destination": ["read_frames"],
    "tdgather.api.writing": ["merge", "WriteLoop._spill"],
    "tdgather.api.collector": ["Collector.add", "Collector.__enter__", "Collector.__exit__"],
    "tdgather.comm.protocol": ["open_shm", "Joiner.join"],
    "tdgather.comm.transport": ["decode_json", "decode_header", "decode_index", "Channel.recv_answer"],
    "tdgather.comm.shm": ["ShmWriter.write", "ShmWriter._handed_back", "hand_back", "_fill"],
    "tdgather.core.scatter": ["joined_chunks", "scatter_chunks"],
    "tdgather.comm.direct": ["ResultMemory.arena", "Target.write", "Target.open"],
    "tdgather.storage.writer": [
        "DatasetWriter._write_shard",
        "DatasetWriter.write",
        "DatasetWriter.combine",
        "DatasetWriter.commit",
    ],
    "tdgather.storage.shards": ["items_of", "fill", "shard_tensors"],
    "tdgather.storage.catalog": ["Catalog.add_shard", "Catalog.load", "Catalog.json_chunks"],
    "tdgather.storage.atomic": ["LocalFS.writev"],
    "tdgather.storage.store": ["LocalStore.put", "crc32"],  # crc32: zlib-ng's (or zlib's) CRC-32 of each shard
    "tdgather.format.codec": ["encode"],
    "os": ["fsync"],
}
_EVENTS: list[tuple[str, float, float]] = []
_LOCK = threading.Lock()


def _instrument() -> None:
    import importlib

    for module, names in STAGES.items():
        mod = importlib.import_module(module)
        for name in names:
            owner, attr = (getattr(mod, name.split(".")[0]), name.split(".")[1]) if "." in name else (mod, name)
            fn = getattr(owner, attr)
            label = f"{module.rsplit('.', 1)[-1]}.{name}"

            def timed(*a, _fn=fn, _label=label, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    with _LOCK:
                        _EVENTS.append((_label, t, time.perf_counter()))

            setattr(owner, attr, functools.wraps(fn)(timed))


def _call(kind: str, arg: str, scratch: str, number: int, state: dict, pace: float = 0.0) -> None:
    rank = dist.get_rank()
    if kind in ("gather", "dict"):
        state["held"] = tdgather.gather(state["store"])  # freed after the clock stops, as the suite does
        return
    path = os.path.join(scratch, f"c{number}")
    if kind == "images":
        with tdgather.Collector(path, progress=False, timeout=600, ranks_per_writer=state["writers"]) as col:
            for names, batch in state["images"]:
                col.add(names, [0] * len(names), batch)
        return
    frames = state["data"].view(-1, 1 << 20)
    with tdgather.Collector(path, progress=False, timeout=600, ranks_per_writer=state["writers"]) as col:
        for lo in range(0, frames.shape[0], 32):
            batch = frames[lo : lo + 32]
            col.add(f"r{rank}.bin", torch.arange(lo, lo + batch.shape[0]), batch)
            time.sleep(pace)


def _rank(kind: str, arg: str, repeats: int, scratch: str, pace: float = 0.0, writers: int | None = None) -> dict:
    from benchmarks import workloads

    rank, world = dist.get_rank(), dist.get_world_size()
    state: dict = {"writers": writers}
    if kind == "gather":
        state["store"] = tdgather.FrameStore(copy=False)
        for names, idx, frames in workloads.batches(arg, rank, world):
            state["store"].add(names, idx, frames)
    elif kind == "dict":  # the seed's form: {filename: [(frame_idx, frame), ...]}, each frame a tensor of its own
        state["store"] = {}
        for names, idx, frames in workloads.batches(arg, rank, world):
            for name, i, frame in zip(names, idx.tolist(), frames, strict=True):
                state["store"].setdefault(name, []).append((i, frame.clone()))
    elif kind == "images":
        names = [f"img_{i:07d}.jpg" for i in range(rank, int(arg), world)]
        state["images"] = [
            (names[i : i + 500], torch.randn(len(names[i : i + 500]), 256)) for i in range(0, len(names), 500)
        ]
    else:
        n = int(arg) << 20 if rank else 0
        state["data"] = torch.randint(0, 255, (n,), dtype=torch.uint8)
    _instrument()
    calls = []
    for k in range(repeats + 1):
        _EVENTS.clear()
        dist.barrier()
        t0 = time.perf_counter()
        _call(kind, arg, scratch, k, state, pace)
        total = time.perf_counter() - t0
        state.pop("held", None)
        dist.barrier()
        if rank == 0:
            for entry in os.scandir(scratch):
                shutil.rmtree(entry.path, ignore_errors=True)
        if k:
            stages: dict[str, list[float]] = {}
            for label, a, b in _EVENTS:
                s = stages.setdefault(label, [0.0, 0, 1e9, 0.0])
                s[0] += b - a
                s[1] += 1
                s[2] = min(s[2], a - t0)
                s[3] = max(s[3], b - t0)
            stages["(the call)"] = [total, 1, 0.0, total]
            calls.append(stages)
    out = {}
    for label in calls[0]:
        rows = [c[label] for c in calls if label in c]
        out[label] = [statistics.median(r[i] for r in rows) for i in range(4)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["gather", "dict", "collector", "images"])
    p.add_argument(
        "arg",
        help="gather, dict: a workload (tiny, mixed, large, ...); collector: MB a sender streams; images: filenames",
    )
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pace", type=float, default=0.0, help="collector: seconds between batches of 32 MiB")
    p.add_argument("--ranks-per-writer", type=int, help="collector: one writer per this many ranks (1: every rank)")
    args = p.parse_args()
    scratch = tempfile.mkdtemp(prefix="tdgather-stages-")
    try:
        results = run_local_world(
            _rank, args.world, args.kind, args.arg, args.repeats, scratch, args.pace, args.ranks_per_writer, timeout=900
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    pace = f", {args.pace:g} s between batches" if args.pace else ""
    pace += f", ranks_per_writer={args.ranks_per_writer}" if args.ranks_per_writer else ""
    print(f"# {args.kind} {args.arg}, {args.world} ranks{pace}, median of {args.repeats}; ms from the barrier")
    for rank, stages in enumerate(results):
        print(f"rank {rank}")
        for label, (total, n, first, last) in sorted(stages.items(), key=lambda kv: kv[1][2]):
            print(f"  {label:34s} {total * 1e3:8.1f} ms  x{n:<5.0f} {first * 1e3:7.1f} -> {last * 1e3:7.1f}")


if __name__ == "__main__":
    main()
