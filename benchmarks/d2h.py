"""Device-to-host throughput: the copies a CUDA batch can take from the GPU to memory rank dst maps.

Each of ``--batches`` batches of ``--batch`` frames is made on the GPU (as a model's output would
be), then handed to the host in chunks of ``--chunk-mb``, as a Collector's sender makes them:

- ``arena``: what a Collector's sender on rank dst's host does: ``FrameStore.add`` into the chunk's
  shm ring file (`tdgather.comm.arena.Arena`), page-locked once with ``cudaHostRegister``: one
  asynchronous copy per byte, waited for once per chunk;
- ``store_then_shm``: what it did before: ``FrameStore.add`` into pinned memory of the store's own,
  then, per chunk, a copy of it into a ring file (the send's);
- ``shm_pageable``: each batch copied by the GPU straight into a ring file that is not page-locked
  (CUDA stages the copy, and the call waits for it);
- ``store``: ``FrameStore.add`` alone, into pinned memory of its own (`gather`'s path; nothing in shm);
- ``cpu``: ``tensor.cpu()`` per batch (pageable, synchronous; nothing in shm).

Ring files are reused chunk after chunk, as a sender's are once rank dst hands them back. Reported:
GB/s for each (the best of ``--repeats``, after a warm-up run that also page-locks the ring file),
each as a ratio to ``store_then_shm``, and what page-locking one ring file costs (once per file).
Needs CUDA.

    python -m benchmarks.d2h --batches 200 --batch 32 --frame 3 256 256
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator

import torch

from tdgather.comm.pinning import register
from tdgather.comm.shm import ShmWriter
from tdgather.comm.shmfiles import hand_back
from tdgather.core.framestore import FrameStore

Method = Callable[[list[torch.Tensor]], None]


def _timed(fn: Method, outputs: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(outputs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _no_pin(mm, device) -> None:
    return None


def _split(outputs: list[torch.Tensor], chunk: int) -> Iterator[list[torch.Tensor]]:
    """The batches a chunk at a time: a chunk is sent once it holds ``chunk`` bytes."""
    part, size = [], 0
    for out in outputs:
        part.append(out)
        size += out.nbytes
        if size >= chunk:
            yield part
            part, size = [], 0
    if part:
        yield part


def _added(store: FrameStore, batches: list[torch.Tensor]) -> FrameStore:
    for b, out in enumerate(batches):
        store.add(f"video_{b}.mp4", torch.arange(out.shape[0]), out)
    store.synchronize()
    return store


def arena(writer: ShmWriter, chunk: int) -> Method:
    def run(outputs: list[torch.Tensor]) -> None:
        for batches in _split(outputs, chunk):
            store = _added(FrameStore(arena=writer.arena(2 * chunk)), batches)
            start = torch.frombuffer(store.arena.kept.mm, dtype=torch.uint8).data_ptr()
            held = [c.tensors[0].data_ptr() for _, cs in store.groups() for c in cs]
            assert all(start <= p < start + store.arena.kept.size for p in held), "a batch is not in the arena"
            store.arena.release()  # back to the ring (no rank dst here)

    return run


def _into_ring(writer: ShmWriter, chunk: int, tensors: list[torch.Tensor]) -> None:
    """``tensors`` copied back to back into a ring file (from the host, or by the GPU into pages not locked)."""
    kept = writer.claim(2 * chunk)
    writer.allocate(kept, kept.size)
    dst, at = torch.frombuffer(kept.mm, dtype=torch.uint8), 0
    for t in tensors:
        dst[at : at + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        at += t.nbytes
    hand_back(kept.path)


def store_then_shm(writer: ShmWriter, chunk: int) -> Method:
    def run(outputs: list[torch.Tensor]) -> None:
        for batches in _split(outputs, chunk):
            store = _added(FrameStore(), batches)
            _into_ring(writer, chunk, [c.tensors[0] for _, chunks in store.groups() for c in chunks])

    return run


def shm_pageable(writer: ShmWriter, chunk: int) -> Method:
    def run(outputs: list[torch.Tensor]) -> None:
        for batches in _split(outputs, chunk):
            _into_ring(writer, chunk, batches)

    return run


def store(outputs: list[torch.Tensor]) -> None:
    _added(FrameStore(), outputs)


def cpu(outputs: list[torch.Tensor]) -> None:
    kept = [out.cpu() for out in outputs]
    assert len(kept) == len(outputs)


def pin_cost(size: int, repeats: int) -> float:
    """Seconds to page-lock an shm file of ``size`` bytes whose pages are allocated (the best of ``repeats``)."""
    writer, best = ShmWriter(pin=_no_pin), float("inf")
    kept = writer.claim(size)
    writer.allocate(kept, size)
    for _ in range(repeats):
        start = time.perf_counter()
        unpin = register(kept.mm, torch.device("cuda", torch.cuda.current_device()))
        best = min(best, time.perf_counter() - start)
        assert unpin is not None, "cudaHostRegister of an shm file failed"
        unpin()
    hand_back(kept.path)
    writer.cleanup()
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.d2h", description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--frame", type=int, nargs="+", default=[3, 256, 256])
    p.add_argument("--chunk-mb", type=int, default=64, help="a chunk's bytes (the Collector's largest default)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.d2h needs a CUDA device", file=sys.stderr)
        return 2
    outputs = [torch.randn((args.batch, *args.frame), device="cuda") for _ in range(args.batches)]
    nbytes = sum(o.numel() * o.element_size() for o in outputs)
    chunk = args.chunk_mb << 20
    locked, unlocked = ShmWriter(), ShmWriter(pin=_no_pin)  # the first page-locks its ring files
    methods = {
        "arena": arena(locked, chunk),
        "store_then_shm": store_then_shm(unlocked, chunk),
        "shm_pageable": shm_pageable(unlocked, chunk),
        "store": store,
        "cpu": cpu,
    }
    best = {}
    for name, fn in methods.items():
        fn(outputs)  # warm-up: pinned pool, CUDA context, the ring file made and page-locked
        best[name] = min(_timed(fn, outputs) for _ in range(args.repeats))
    locked.cleanup(), unlocked.cleanup()
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {nbytes / 1e9:.2f} GB, "
        f"chunks of {args.chunk_mb} MiB, best of {args.repeats}"
    )
    for name, s in best.items():
        print(f"{name:15s} {nbytes / s / 1e9:7.2f} GB/s  {best['store_then_shm'] / s:5.2f}x store_then_shm")
    print(
        f"page-locking one {2 * args.chunk_mb} MiB ring file (once per file): "
        f"{pin_cost(2 * chunk, args.repeats) * 1e3:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
