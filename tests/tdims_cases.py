"""Multi-crop outputs: TensorDicts and tensorclasses of batch size ``[B, 3]``, over ranks, and the world cases.

Every rank derives the whole job from the filenames and frame indexes, so rank 0 knows what each
frame must be: per frame 3 crops, each with float32 logits ``[10]``, a bfloat16 embedding ``[4]``
and an int64 box ``[4]``, plus (in the TensorDict form) one JSON value per frame. Frames go to
ranks as a ``DistributedSampler(drop_last=False)`` gives them, padding included (exact copies),
in batches of ``batch`` frames: ``TensorDict(..., batch_size=[B, 3])``, or for the filenames
``tc_*`` a `Crops` tensorclass of that batch size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict, is_tensorclass, tensorclass

import tdgather

from .cases import bits, value

CROPS = 3


@tensorclass
class Crops:
    logits: torch.Tensor
    emb: torch.Tensor


def name_of(file: int) -> str:
    return f"{'tc' if file % 3 == 2 else 'td'}_{file:03d}.mp4"


def leaves(name: str, idx: int) -> dict[str, torch.Tensor]:
    """Frame ``idx`` of ``name``: its leaves, each ``[3, ...]`` (one row a crop)."""
    out = {
        "logits": value(name, idx, (CROPS, 10)),
        "emb": value(name, idx + 10_000, (CROPS, 4), torch.bfloat16),
    }
    if name.startswith("td"):
        out["box"] = value(name, idx + 20_000, (CROPS, 4), torch.int64)
    return out


def batch(names: list[str], idx: list[int]):
    """The frames of ``(names, idx)`` as one batch of batch size ``[B, 3]`` (all ``td_*`` or all ``tc_*``)."""
    per = [leaves(n, i) for n, i in zip(names, idx, strict=True)]
    stacked = {k: torch.stack([p[k] for p in per]) for k in per[0]}
    size = [len(names), CROPS]
    if names[0].startswith("tc"):
        return Crops(logits=stacked["logits"], emb=stacked["emb"], batch_size=size)
    td = TensorDict({"logits": stacked["logits"], "crop": {"emb": stacked["emb"], "box": stacked["box"]}}, size)
    td["model"] = "vit-b"  # one JSON value per frame (the same over its crops)
    return td


def batches(rank: int, world: int, files: int, per_file: int, size: int):
    """Rank ``rank``'s ``(filenames, frame_idx, frames)`` batches: a padded sampler's share, one kind per batch."""
    order = [(f, i) for f in range(files) for i in range(per_file)]
    g = torch.Generator().manual_seed(7)
    order = [order[k] for k in torch.randperm(len(order), generator=g).tolist()]
    order += order[: -len(order) % world]  # DistributedSampler's padding: exact copies
    mine = order[rank::world]
    for kind in ("td", "tc"):
        rows = [(name_of(f), i) for f, i in mine if name_of(f).startswith(kind)]
        for lo in range(0, len(rows), size):
            names, idx = zip(*rows[lo : lo + size], strict=True)
            yield list(names), torch.tensor(idx), batch(list(names), list(idx))


def check_frames(name: str, clip, per_file: int) -> None:
    """One filename's frames as read back: batch size ``[T, 3]``, crop views working, every value bit-exact."""
    t = per_file
    frames = clip.frames
    assert clip.frame_idx.tolist() == list(range(t)), name
    assert tuple(frames.batch_size) == (t, CROPS), f"{name}: batch size {frames.batch_size}"
    want = [leaves(name, i) for i in range(t)]
    if name.startswith("tc"):
        assert type(frames) is Crops, f"{name}: {type(frames)}"
        got = {"logits": frames.logits, "emb": frames.emb}
    else:
        assert type(frames) is TensorDict, f"{name}: {type(frames)}"
        got = {"logits": frames["logits"], "emb": frames["crop", "emb"], "box": frames["crop", "box"]}
        assert frames[:, 0]["model"] == ["vit-b"] * t and frames[0, 1]["model"] == "vit-b", name
    for k, v in got.items():
        w = torch.stack([x[k] for x in want])
        assert v.dtype == w.dtype and v.shape == w.shape, f"{name}.{k}: {v.dtype}{list(v.shape)}"
        assert torch.equal(bits(v), bits(w)), f"{name}.{k}: values differ"
    first = frames[:, 0]  # the first crop of every frame
    assert tuple(first.batch_size) == (t,) and is_tensorclass(first) == name.startswith("tc"), name
    assert torch.equal(bits(first.get("logits")), bits(torch.stack([x["logits"][0] for x in want]))), name
    one = clip.at(t - 1).frames  # one frame: its crops
    assert tuple(one.batch_size) == (CROPS,), f"{name}: one frame's batch size {one.batch_size}"


def check_all(result, files: int, per_file: int) -> None:
    assert sorted(result) == sorted(name_of(f) for f in range(files))
    for name in result:
        check_frames(name, result[name], per_file)


def case_gather_save(out: str, files: int, per_file: int, size: int) -> dict | None:
    """Multi-crop batches through a FrameStore, `gather` and `save`: batch size [T, 3] in the result and on disk."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store = tdgather.FrameStore()
    for names, idx, frames in batches(rank, world, files, per_file, size):
        store.add(names, idx, frames)
    result = tdgather.gather(store, timeout=120)
    if rank != 0:
        return None
    check_all(result, files, per_file)
    tdgather.save(result, out)
    ds = tdgather.open(out)
    check_all(ds, files, per_file)
    item = ds.per_frame()[0]  # one frame, as a DataLoader gets it
    assert tuple(item["frames"].batch_size) == (CROPS,), item
    groups = [g for s in ds.index["shards"].values() for g in s["groups"].values()]
    return {
        "frames": result.stats.frames,
        "duplicates": result.stats.duplicates_dropped,
        "batch_dims": sorted({tuple(g.get("batch_dims", ())) for g in groups}),
    }


def case_collector(out: str, files: int, per_file: int, size: int, budget: int) -> dict | None:
    """The same batches through a Collector with a small budget: many shards, filenames over several segments."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with tdgather.Collector(out, memory_budget=budget, chunk_bytes=budget // 16, timeout=120, progress=False) as col:
        for names, idx, frames in batches(rank, world, files, per_file, size):
            col.add(names, idx, frames)
    if rank != 0:
        return None
    ds = tdgather.open(out)
    ds.verify()
    check_all(ds, files, per_file)
    return {
        "shards": len(ds.index["shards"]),
        "segments": max(len(e["segments"]) for e in ds.index["files"].values()),
        "duplicates": col.summary.duplicates_dropped,
    }
