"""Detections whose box counts vary, given with no ``ragged=``, and the world cases that gather them.

Every rank derives the whole job from one seed. Frame ``i`` of a filename goes to rank
``i % world``. The filenames are chosen so that a leaf's first dim varies where each case needs it:

- ``same.mp4``: 3 boxes in every frame (never varies: stored fixed, read ragged like the rest);
- ``late.mp4``: 2 boxes in the first half of its frames, then 0 to 4 (found late, on every rank);
- ``cross.mp4``: 0 boxes on rank 0, 2 on the others (each rank sees one length: found only at rank dst);
- ``pairs.mp4``: 1 box on ranks 0 and 1, 3 on ranks 2 and 3 (with 2 ranks per writer, one writer sees 1 only);
- ``rand_k.mp4``: 0 to 4 boxes.

A batch whose frames all have the same count comes as the model would give it: stacked tensors
``[B, n, 4]``; other batches as a list of per-frame dicts (or in the other forms a user has).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

import tdgather

FRAMES = 12  # per filename
NAMES = ["same.mp4", "late.mp4", "cross.mp4", "pairs.mp4", "rand_0.mp4", "rand_1.mp4"]


def count(name: str, i: int, world: int) -> int:
    """Boxes in frame ``i`` of ``name``."""
    if name == "same.mp4":
        return 3
    if name == "late.mp4":
        return 2 if i < FRAMES // 2 else (i * 7) % 5
    if name == "cross.mp4":
        return 0 if i % world == 0 else 2
    if name == "pairs.mp4":
        return 1 if i % world < 2 else 3
    return (i * 5 + len(name) * 3) % 5


def frame(name: str, i: int, world: int) -> dict:
    """Frame ``i`` of ``name``: its boxes, scores and a fixed-size embedding, from a seed of its own."""
    g = torch.Generator().manual_seed(NAMES.index(name) * 1000 + i)
    n = count(name, i, world)
    return {
        "boxes": torch.rand(n, 4, generator=g) * 640,
        "scores": torch.rand(n, generator=g),
        "feat": torch.rand(8, generator=g),
    }


def mine(rank: int, world: int, first: int = 0, last: int = FRAMES) -> list[tuple[str, int]]:
    """This rank's frames, in loop order: the early frames of every filename first, as a sampler interleaves."""
    return [(name, i) for i in range(first, last) for name in NAMES if i % world == rank]


def give(col, frames: list[tuple[str, int]], world: int, form: str, batch: int = 4) -> None:
    """Hand ``frames`` over in batches of ``batch``, in ``form``, with no ``ragged=``."""
    for lo in range(0, len(frames), batch):
        part = frames[lo : lo + batch]
        values = [frame(name, i, world) for name, i in part]
        names, idx = [name for name, _ in part], [i for _, i in part]
        if form == "update":  # the dict form: {filename: [(frame_idx, value), ...]}
            pred: dict = {}
            for name, i, v in zip(names, idx, values, strict=True):
                pred.setdefault(name, []).append((i, v))
            col.update(pred)
        elif form == "list":  # add() with a list of per-frame dicts
            col.add(names, idx, values)
        elif form == "model":  # stacked [B, n, 4] where the batch's counts agree (a LongTensor of indexes)
            if len({v["boxes"].shape[0] for v in values}) == 1:
                stacked = {k: torch.stack([v[k] for v in values]) for k in values[0]}
                col.add(names, torch.tensor(idx), stacked)
            else:
                col.add(names, torch.tensor(idx), values)
        else:
            raise ValueError(form)


def check(ds, world: int, names: list[str] | None = None) -> dict:
    """Every frame of ``ds`` bit for bit, each leaf one type across filenames; what was seen."""
    stored = set()
    for name in names or NAMES:
        got = ds[name]
        assert got.frame_idx.tolist() == list(range(FRAMES)), (name, got.frame_idx.tolist())
        boxes, scores = got.frames["boxes"], got.frames["scores"]
        assert boxes.is_nested and scores.is_nested, name
        assert str(ds.layout(name).describe()) == "{boxes: float32[*, 4], feat: float32[8], scores: float32[*]}"
        for i, (b, s, f) in enumerate(zip(boxes.unbind(), scores.unbind(), got.frames["feat"], strict=True)):
            want = frame(name, i, world)
            assert torch.equal(b, want["boxes"]) and torch.equal(s, want["scores"]), (name, i)
            assert torch.equal(f, want["feat"]), (name, i)
        assert ds.lengths(name)["boxes"].tolist() == [count(name, i, world) for i in range(FRAMES)]
        stored.add(ds.stored_layout(name).describe())
    return {"stored": sorted(stored), "files": len(ds), "version": ds.index["version"]}


def case_gather(form: str) -> dict | None:
    """``gather`` of a dict built from every form: promoted within a rank and across ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store = tdgather.FrameStore()
    give(store, mine(rank, world), world, form)
    out = tdgather.gather(store)
    if rank:
        return None
    return {"files": sorted(out), "types": sorted({out[n].frames["boxes"].is_nested for n in out})} | _same(out, world)


def _same(out, world: int) -> dict:
    for name in NAMES:
        for i, (b, f) in enumerate(zip(out[name].frames["boxes"].unbind(), out[name].frames["feat"], strict=True)):
            want = frame(name, i, world)
            assert torch.equal(b, want["boxes"]) and torch.equal(f, want["feat"]), (name, i)
    return {"checked": len(NAMES)}


def case_collector(
    path: str,
    form: str,
    budget: int,
    chunk: int | None = None,
    per_writer: int | None = None,
    shard_bytes: int = 1 << 30,
) -> dict | None:
    """A Collector with no ``ragged=``; a small ``shard_bytes`` writes filenames before their counts vary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with tdgather.Collector(
        path,
        memory_budget=budget,
        chunk_bytes=chunk,
        ranks_per_writer=per_writer,
        max_shard_bytes=shard_bytes,
        progress=False,
    ) as col:
        give(col, mine(rank, world), world, form)
    if rank:
        return None
    ds = tdgather.open(path)
    return check(ds, world) | {"shards": len(ds.index["shards"]), "dups": col.summary.duplicates_dropped}


def case_resume(path: str) -> dict | None:
    """Attempt 1 sends late.mp4's first half (2 boxes each: stored fixed) and fails; attempt 2 sends all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    given = Path(f"{path}.given")  # rank 1 has added its half: rank 0 fails only then (else rank 1's add may
    try:  # raise rank 0's failure, a PeerError, before it adds them all)
        with tdgather.Collector(path, progress=False) as col:
            give(
                col,
                [(n, i) for n, i in mine(rank, world, 0, FRAMES // 2) if n == "late.mp4"],
                world,
                "model",
            )
            if rank:
                given.touch()
            deadline = time.monotonic() + 60
            while not rank and not given.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("attempt 1 stops here")
    except RuntimeError as e:
        if "attempt 1" not in str(e) and rank == 0:
            raise
    first = None
    if rank == 0:
        first = tdgather.open(path, incomplete=True).stored_layout("late.mp4").describe()
    with tdgather.Collector(path, resume=True, progress=False) as col:
        give(col, mine(rank, world), world, "list")  # everything again: the saved frames are copies
    if rank:
        return None
    ds = tdgather.open(path)
    return check(ds, world) | {
        "first": first,
        "dups": col.summary.duplicates_dropped,
        "attempts": len(ds.metadata["attempts"]),
    }


def case_fixed(path: str, where: str) -> dict | None:
    """``ragged=False``: a first dim that changes is refused, on the rank that gives it where it can know."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = ["late.mp4"] if where == "rank" else ["cross.mp4"]
    frames = [(n, i) for n, i in mine(rank, world) if n in names]
    try:
        with tdgather.Collector(path, ragged=False, progress=False) as col:
            give(col, frames, world, "list", batch=1)
    except tdgather.TdgatherError as e:
        return {"type": type(e).__name__, "msg": str(e)}
    return {"type": None}
