"""Device-to-host throughput: `FrameStore.add` (one pinned, asynchronous copy) against ``tensor.cpu()``.

Each of ``--batches`` batches of ``--batch`` frames is made on the GPU (as a model's output would
be), then handed to the host: by ``FrameStore.add`` (pinned buffer, ``non_blocking``, one event,
synchronised once before packing), or by ``.cpu()`` per batch (pageable, synchronous). Reported:
GB/s for each, and their ratio. Needs CUDA.

    python -m benchmarks.d2h --batches 200 --batch 32 --frame 3 256 256
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import tdgather


def _timed(fn, outputs: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(outputs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def with_store(outputs: list[torch.Tensor]) -> None:
    store = tdgather.FrameStore()
    for b, out in enumerate(outputs):
        store.add(f"video_{b}.mp4", torch.arange(out.shape[0]), out)
    store.synchronize()


def with_cpu(outputs: list[torch.Tensor]) -> None:
    kept = [out.cpu() for out in outputs]
    assert len(kept) == len(outputs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.d2h", description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--frame", type=int, nargs="+", default=[3, 256, 256])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.d2h needs a CUDA device", file=sys.stderr)
        return 2
    outputs = [torch.randn((args.batch, *args.frame), device="cuda") for _ in range(args.batches)]
    nbytes = sum(o.numel() * o.element_size() for o in outputs)
    with_store(outputs[:2]), with_cpu(outputs[:2])  # warm-up: pinned pool, CUDA context
    store = min(_timed(with_store, outputs) for _ in range(args.repeats))
    cpu = min(_timed(with_cpu, outputs) for _ in range(args.repeats))
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {nbytes / 1e9:.2f} GB")
    print(f"FrameStore.add (pinned, non_blocking): {nbytes / store / 1e9:.2f} GB/s")
    print(f"tensor.cpu() per batch:                {nbytes / cpu / 1e9:.2f} GB/s")
    print(f"ratio: {cpu / store:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
