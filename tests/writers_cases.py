"""Rank functions for tests/test_writers.py: one dataset from many writers (`tdgather.format.blocks`)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

import tdgather
from tests import cases


def padded_batches(rank: int, world: int, videos: int = 5, frames: int = 13, batch: int = 4):
    """A shuffled DistributedSampler with padding over (video, frame) pairs, run in batches.

    A padded copy is computed on another rank than its first copy, and differs from it in the last
    bits, as a model's outputs do in another batch.
    """
    from torch.utils.data import DataLoader, DistributedSampler

    items = [(f"v{v}.mp4", j) for v in range(videos) for j in range(frames)]
    sampler = DistributedSampler(items, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = DataLoader([(n, torch.tensor(j)) for n, j in items], batch_size=batch, sampler=sampler)
    for names, idx in loader:
        x = torch.stack([cases.value(n, int(j), (2, 3)) for n, j in zip(names, idx, strict=True)])
        yield names, idx, x * (1 + rank * 2**-20)


def predictions(scenario: str, rank: int, world: int) -> dict:
    """`tests.cases.predictions`, and scenarios whose copies or layouts differ between the first and last block."""
    if scenario == "split+dup":  # one video strided over every rank; the last rank repeats two of rank 0's frames
        return {**cases.predictions("split", rank, world), **cases.predictions("dup_identical", rank, world)}
    if scenario == "far_conflict":  # ranks 0 and the last hold x.mp4; the last rank's copy of frame 1 differs
        p = {"x.mp4": [(j, cases.value("x.mp4", j)) for j in range(3)]} if rank in (0, world - 1) else {}
        if rank == world - 1:
            p["x.mp4"][1] = (1, cases.value("x.mp4", 1) + 1)
        return p
    if scenario == "far_shape":  # the first block's frames are [3], the others' [3, 4]: layouts that do not fit
        return {"x.mp4": (rank, cases.value("x.mp4", rank, (3,) if rank < 2 else (3, 4)))}
    return cases.predictions(scenario, rank, world)


def case_writers(out: str, k: int | None, scenario: str, duplicates: str = "keep", shard_bytes: int = 1 << 30) -> dict:
    """Every rank's frames, one writer per k ranks (None: rank 0 alone); what each rank's close returned."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = dict(timeout=60, progress=False, duplicates=duplicates, max_shard_bytes=shard_bytes, ranks_per_writer=k)
    with tdgather.Collector(out, **kw) as col:
        if scenario == "padded":
            for names, idx, x in padded_batches(rank, world):
                col.add(names, idx, x)
        else:
            col.update(predictions(scenario, rank, world))
    s = col.summary
    return None if s is None else {"frames": s.frames, "per_rank": s.frames_per_rank, "dups": s.duplicates.to_json()}


def case_writers_reporting(out: str, k: int | None, scenario: str, duplicates: str = "keep") -> dict:
    """`case_writers`, returning the error each rank saw instead of raising."""
    try:
        return {"ok": case_writers(out, k, scenario, duplicates)}
    except (tdgather.TdgatherError, ValueError) as e:
        return {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None)}


def case_mismatched_writers(out: str) -> dict:
    """Ranks 0 and 1 ask for one writer per 2 ranks, the others for rank 0 alone."""
    k = 2 if dist.get_rank() < 2 else None
    try:
        with tdgather.Collector(out, ranks_per_writer=k, timeout=10, progress=False) as col:
            col.update(cases.predictions("uneven", dist.get_rank(), dist.get_world_size()))
    except tdgather.TdgatherError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def case_far_apart(out: str, slow: int, seconds: float, timeout: float) -> dict:
    """Rank ``slow`` works ``seconds`` (several timeouts) after the others closed; one writer per 2 ranks."""
    rank = dist.get_rank()
    start = time.monotonic()
    with tdgather.Collector(out, timeout=timeout, progress=False, ranks_per_writer=2) as col:
        col.update({f"r{rank}.mp4": [(j, torch.full((4,), float(rank))) for j in range(3)]})
        if rank == slow:  # a long inference tail: slow batches, each under the timeout (the loop progresses)
            for _ in range(round(seconds / (timeout / 2))):
                time.sleep(timeout / 2)
                col.status()
    return {"frames": col.summary.frames if col.summary else None, "waited": time.monotonic() - start}


def case_writer_without_the_output(out: str) -> dict:
    """Rank 2, a writer, does not see rank 0's output directory (as a node without the shared filesystem).

    Every rank names the output by a relative path; rank 2 runs in another directory.
    """
    import os

    rank, world = dist.get_rank(), dist.get_world_size()
    here = Path(out).parent / ("elsewhere" if rank == 2 else "")
    here.mkdir(exist_ok=True)
    os.chdir(here)
    try:
        with tdgather.Collector(Path(out).name, ranks_per_writer=2, timeout=30, progress=False) as col:
            col.update(cases.predictions("uneven", rank, world))
    except tdgather.TdgatherError as e:
        return {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None)}
    return {"type": None}


def case_writer_stops(out: str, timeout: float) -> dict:
    """Rank 2, the second writer, stops (SIGSTOP) in its loop; the others must fail within the timeout."""
    import os
    import signal

    rank = dist.get_rank()
    try:
        with tdgather.Collector(out, ranks_per_writer=2, timeout=timeout, progress=False) as col:
            col.update({f"r{rank}": (0, torch.ones(2))})
            if rank == 2:
                Path(out + ".pid").write_text(str(os.getpid()))  # the test SIGKILLs it later, as torchrun would
                os.kill(os.getpid(), signal.SIGSTOP)
    except tdgather.TdgatherError as e:
        return {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None), "at": time.time()}
    return {"type": None}


def case_coordinator_writes_first(out: str, wait: float) -> bool | None:
    """2 ranks, a writer each: rank 1 holds its Collector open until rank 0's own shard is on disk.

    Rank 0 closes first; its shard must be written while rank 1 (another writer, which sends no
    frames to it) still runs, not after rank 1's report. Rank 1 returns whether it saw the shard.
    """
    rank = dist.get_rank()
    partial = Path(out + ".partial")
    with tdgather.Collector(out, timeout=60, progress=False, ranks_per_writer=1) as col:
        col.add([f"r{rank}.jpg"], [0], torch.full((1, 3), float(rank)))
        if rank == 1:
            deadline = time.monotonic() + wait
            while not any(p.name.startswith("shard-00000-") for p in partial.glob("*.safetensors")):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
    return rank == 1 or None
