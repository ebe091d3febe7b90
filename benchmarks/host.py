"""One host's limits, measured where it runs: gloo, shared memory and the disk, beside tdgather's Collector.

Run: ``python -m benchmarks.host --world 2 4 --mb 300 --repeats 3``

Every sender (ranks 1..W-1) holds ``--mb`` MB (pre-touched); the figure is rank 0's seconds from a
barrier until it holds every byte (median of ``--repeats`` after a warm-up), and GB/s of the
senders' bytes. Between calls rank 0 removes what the call wrote and runs ``sync``, so that no call
pays for the writeback of the one before. Methods:

- ``gloo_fresh``: ``isend`` / ``irecv`` into new buffers on rank 0 (its first-touch page faults included);
- ``gloo_reused``: the same into buffers rank 0 touched before;
- ``shm_copy``: each sender writes its bytes into a new ``/dev/shm`` file and says so (a 1-element
  send); rank 0 maps it and copies it into a reused buffer;
- ``shm_map``: the same, rank 0 maps the file: bytes in hand, no copy;
- ``disk``: each sender writes its own file under ``--dir`` and fsyncs it (the disk's limit for
  a Collector, which must write every byte once);
- ``collector_shm``, ``collector_gloo``: `tdgather.Collector` to ``--dir`` (frames of 1 MiB in
  batches of 32, each batch a tensor of its own as a model's output is, made before the timing; the
  default budget), through shared memory segments and with ``TDGATHER_SHM=0``: open to close on rank 0;
- ``collector_shm_1thread``, ``collector_shm_2threads``, ``collector_shm_4threads``: ``collector_shm``
  with ``write_threads`` 1, 2 and 4 (the default is a quarter of the cores, 1 to 4: 1 on 2 cores);
- ``collector_writers``: the same with ``ranks_per_writer=1``: every rank writes its own shards into
  the one dataset, rank 0 only lists them at close (what ``disk`` does, plus the index);
- ``collector_shm_nocopy``, ``collector_writers_nocopy``: ``collector_shm`` and ``collector_writers``
  with ``copy=False`` (`add` keeps the batch it is given instead of copying it: right for a loop
  whose every batch is a new tensor);
- ``gather_shm``, ``gather_gloo``: `tdgather.gather` of the same frames (a filled `FrameStore`, one
  file a sender), the senders writing into rank 0's result themselves, and with ``TDGATHER_SHM=0``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.launch import run_local_world

FRAME = 1 << 20


def _signal(peer: int) -> None:
    dist.send(torch.ones(1, dtype=torch.int64), dst=peer)


def _wait_all(world: int) -> None:
    for p in range(1, world):
        dist.recv(torch.empty(1, dtype=torch.int64), src=p)


def gloo(ctx: dict, reuse: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank:
        dist.send(ctx["data"], dst=0)
        return
    bufs = ctx["bufs"] if reuse else [torch.empty(ctx["n"], dtype=torch.uint8) for _ in range(1, world)]
    works = [dist.irecv(b, src=p) for p, b in zip(range(1, world), bufs, strict=True)]
    for w in works:
        w.wait()


def shm(ctx: dict, copy: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    path = f"/dev/shm/tdgather-bench-{os.getpid() if rank else 0}-{rank}"
    if rank:
        fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
        os.ftruncate(fd, ctx["n"])
        with mmap.mmap(fd, ctx["n"]) as mm:
            out = torch.frombuffer(mm, dtype=torch.uint8)
            out.copy_(ctx["data"])
            del out
        os.close(fd)
        dist.send(torch.tensor([os.getpid()]), dst=0)
        return
    held = []
    for p in range(1, world):
        pid = torch.empty(1, dtype=torch.int64)
        dist.recv(pid, src=p)
        name = f"/dev/shm/tdgather-bench-{int(pid)}-{p}"
        fd = os.open(name, os.O_RDONLY)
        mm = mmap.mmap(fd, ctx["n"], access=mmap.ACCESS_COPY)
        os.close(fd)
        os.unlink(name)
        view = torch.frombuffer(mm, dtype=torch.uint8)
        if copy:
            ctx["bufs"][p - 1].copy_(view)
        else:
            held.append(view)
    ctx["held"] = held  # the mappings rank 0 holds (dropped before the next call)


def disk(ctx: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank:
        path = os.path.join(ctx["dir"], f"rank{rank}.bin")
        with open(path, "wb") as f:
            f.write(memoryview(ctx["data"].numpy()))
            f.flush()
            os.fsync(f.fileno())
        _signal(0)
        return
    _wait_all(world)


def collector(
    ctx: dict, shared: bool, ranks_per_writer: int | None = None, copy: bool = True, threads: int | None = None
) -> None:
    rank = dist.get_rank()
    os.environ["TDGATHER_SHM"] = "1" if shared else "0"
    ctx["calls"] = ctx.get("calls", 0) + 1
    path = os.path.join(ctx["dir"], f"col-{ctx['calls']}")
    if "batches" not in ctx:  # a model's outputs: a new tensor a batch, made before the timing
        ctx["batches"] = [b.clone() for b in ctx["data"].view(-1, FRAME).split(32)] if rank else []
    kw = {"ranks_per_writer": ranks_per_writer, "copy": copy, "write_threads": threads}
    with tdgather.Collector(path, progress=False, timeout=600, **kw) as col:
        lo = 0
        for batch in ctx["batches"]:
            col.add(f"r{rank}.bin", torch.arange(lo, lo + batch.shape[0]), batch)
            lo += batch.shape[0]
    if rank == 0 and shared:
        ctx["shared"] = col.summary.shared_chunks


def gather(ctx: dict, shared: bool) -> None:
    rank = dist.get_rank()
    os.environ["TDGATHER_SHM"] = "1" if shared else "0"
    if "store" not in ctx:  # filled once, as an inference loop would have
        ctx["store"] = tdgather.FrameStore(copy=False)
        if rank:
            frames = ctx["data"].view(-1, FRAME)
            ctx["store"].add(f"r{rank}.bin", torch.arange(frames.shape[0]), frames)
    ctx["held"] = tdgather.gather(ctx["store"])  # rank 0 holds every byte


METHODS = {
    "gloo_fresh": lambda c: gloo(c, False),
    "gloo_reused": lambda c: gloo(c, True),
    "shm_copy": lambda c: shm(c, True),
    "shm_map": lambda c: shm(c, False),
    "disk": disk,
    "collector_shm": lambda c: collector(c, True),
    "collector_shm_1thread": lambda c: collector(c, True, threads=1),
    "collector_shm_2threads": lambda c: collector(c, True, threads=2),
    "collector_shm_4threads": lambda c: collector(c, True, threads=4),
    "collector_gloo": lambda c: collector(c, False),
    "collector_writers": lambda c: collector(c, False, ranks_per_writer=1),
    "collector_shm_nocopy": lambda c: collector(c, True, copy=False),
    "collector_writers_nocopy": lambda c: collector(c, False, ranks_per_writer=1, copy=False),
    "gather_shm": lambda c: gather(c, True),
    "gather_gloo": lambda c: gather(c, False),
}


def _rank(mb: int, methods: list[str], repeats: int, scratch: str) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    n = (mb << 20) // FRAME * FRAME
    data = torch.randint(0, 255, (n,), dtype=torch.uint8) if rank else torch.empty(0, dtype=torch.uint8)
    bufs = [torch.ones(n, dtype=torch.uint8) for _ in range(1, world)] if rank == 0 else []
    ctx = {"n": n, "data": data, "bufs": bufs, "dir": scratch}
    out = {}
    for m in methods:
        times = []
        for k in range(repeats + 1):
            ctx.pop("held", None)
            dist.barrier()
            t0 = time.perf_counter()
            METHODS[m](ctx)
            if k:
                times.append(time.perf_counter() - t0)
            dist.barrier()
            if rank == 0:  # the next call writes fresh files, as a run does
                for entry in os.scandir(scratch):
                    shutil.rmtree(entry.path) if entry.is_dir() else os.unlink(entry.path)
                os.sync()  # the removal's journal and any writeback behind us, not in the next call's time
        out[m] = statistics.median(times)
    return {"seconds": out, "bytes": n * (world - 1), "shared": ctx.get("shared")} if rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mb", type=int, default=300, help="MB each sender holds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--dir", default=None, help="where disk and collector write (default: a temporary directory)")
    args = parser.parse_args(argv)
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.mb} MB per sender, median of {args.repeats} after a warm-up"
    )
    rows = {}
    for w in args.world:
        scratch = tempfile.mkdtemp(prefix="tdgather-host-", dir=args.dir)
        try:
            rows[w] = run_local_world(_rank, w, args.mb, args.methods, args.repeats, scratch, timeout=3000)[0]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    print("| method | " + " | ".join(f"W={w}: s, GB/s, vs disk" for w in args.world) + " |")
    print("|---|" + "---|" * len(args.world))
    for m in args.methods:
        cells = []
        for w in args.world:
            r = rows[w]
            s = r["seconds"][m]
            vs = s / r["seconds"]["disk"] if "disk" in r["seconds"] else float("nan")
            cells.append(f"{s:.3f}, {r['bytes'] / s / 1e9:.2f}, {vs:.2f}")
        print(f"| {m} | " + " | ".join(cells) + " |")
    print(
        "chunks through shared memory (collector, last call): "
        + ", ".join(f"W={w}: {rows[w]['shared']}" for w in args.world)
    )


if __name__ == "__main__":
    main()
