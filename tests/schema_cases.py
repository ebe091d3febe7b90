"""World cases for one type per leaf name, decided by every frame of the dataset (tests/test_schema.py).

Each rank predicts its share of a job as a real model's outputs look: prompts of one frame each
(ragged tokens and a text), a detector that finds nothing, a detector that always finds exactly
100 boxes. Rank 0 saves (through `gather` + `save`, or a `Collector`), reads the dataset back and
returns what a user's reading code meets: the leaves read as ragged, each filename's leaf type,
`padded`, and `to_hf` where ``datasets`` is installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

import tdgather

PROMPTS = 23


def _prompts(rank: int, world: int) -> dict:
    """Prompt i (one frame, frame_idx 0): ``i % 7 + 1`` tokens and its text; rank r holds every world-th."""
    return {
        f"prompt-{i:03d}": (0, {"tokens": torch.arange(i % 7 + 1), "text": f"p{i}"})
        for i in range(rank, PROMPTS, world)
    }


def _detections(rank: int, world: int, boxes: int) -> list[tuple[list[str], torch.Tensor, list[dict]]]:
    """Batches of 4 frames of 3 videos a rank: ``boxes`` boxes in every frame, as torchvision returns them."""
    out = []
    for v in range(3):
        name = f"r{rank}-v{v}.mp4"
        for b in range(2):
            dets = [
                {
                    "boxes": torch.rand(boxes, 4),
                    "scores": torch.rand(boxes),
                    "labels": torch.ones(boxes, dtype=torch.int64),
                }
                for _ in range(4)
            ]
            out.append(([name] * 4, torch.arange(4) + 4 * b, dets))
    return out


def _read(path: str) -> dict:
    ds = tdgather.open(path)
    out = {
        "ragged": sorted(ds.ragged_leaves),
        "nested": {
            name: {k: bool(getattr(v, "is_nested", False)) for k, v in ds[name].frames.items() if k != "text"}
            for name in ds
        },
        "files": len(ds),
        "types": [t.describe() for t in ds.schema],
    }
    index = json.loads((Path(path) / "tdgather.index.json").read_text())  # as a reader without tdgather sees it
    out["schema"] = {
        ".".join(x["path"]): [x["dtype"], x["shape"], x.get("ragged", False)]
        for t in index["schema"]
        for x in t["leaves"]
    }
    leaf = "tokens" if "tokens" in out["schema"] else "boxes"
    out["plain_same"] = all(_same(_plain_rows(path, index, name, leaf), ds[name].frames[leaf]) for name in ds)
    first = ds[next(iter(ds))].frames
    if "boxes" in first.keys():
        padded, lengths = tdgather.padded(first["boxes"])
        out["padded"] = [list(padded.shape), lengths.tolist()]
    if importlib.util.find_spec("datasets") is not None:
        hf = ds.to_hf()
        out["hf_rows"] = len(hf)
        out["hf_features"] = {k: type(v).__name__ for k, v in hf.features.items()}
        out["hf_first"] = {k: (len(v) if isinstance(v, list) else v) for k, v in hf[0].items() if k != "filename"}
    return out


def _plain_rows(path: str, index: dict, name: str, leaf: str) -> list[torch.Tensor]:
    """One leaf of a filename's frames, read with safetensors and the index alone (docs/format.md's recipe)."""
    rows, order = [], []
    for e in index["files"][name]["segments"]:
        stored = next(x for x in index["shards"][e["shard"]]["groups"][e["group"]]["leaves"] if x["path"] == [leaf])
        with safe_open(str(Path(path) / e["shard"]), framework="pt") as f:
            lo, hi = e["start"], e["start"] + e["frames"]
            order += f.get_slice(f"{e['group']}:frame_idx")[lo:hi].tolist()
            if stored.get("ragged"):
                offsets = f.get_slice(f"{e['group']}.{leaf}:offsets")[lo : hi + 1]
                values = f.get_slice(f"{e['group']}.{leaf}")[int(offsets[0]) : int(offsets[-1])]
                rows += list(values.split(offsets.diff().tolist()))
            else:
                rows += list(f.get_slice(f"{e['group']}.{leaf}")[lo:hi])
    return [rows[k] for k in sorted(range(len(rows)), key=order.__getitem__)]


def _same(rows: list[torch.Tensor], column: torch.Tensor) -> bool:
    """Whether ``rows`` are the frames of ``column`` (a plain tensor, or a jagged nested tensor), bit for bit."""
    frames = column.unbind() if column.is_nested else list(column)
    return len(rows) == len(frames) and all(torch.equal(a, b) for a, b in zip(rows, frames, strict=True))


def _write_and_read(path: str, how: str, batches: list[tuple[list[str], list | torch.Tensor, list]]) -> dict | None:
    """``batches`` into a `FrameStore`, gathered and saved (``how="gather"``), or into a Collector; rank 0 reads.

    ``how="fixed"``: the Collector with ``ragged=False``.
    """
    if how == "gather":
        store = tdgather.FrameStore()
        for names, idx, values in batches:
            store.add(names, idx, values)
        got = tdgather.gather(store)
        if got is None:
            return None
        tdgather.save(got, path)
    else:  # "collector", or "fixed": a Collector whose frames are declared fixed (ragged=False)
        with tdgather.Collector(path, ragged=False if how == "fixed" else None) as col:
            for names, idx, values in batches:
                col.add(names, idx, values)
        if col.summary is None:
            return None
    return _read(path)


def case_prompts(path: str, how: str) -> dict | None:
    mine = _prompts(dist.get_rank(), dist.get_world_size())
    return _write_and_read(path, how, [([name], [idx], [value]) for name, (idx, value) in mine.items()])


def case_detections(path: str, how: str, boxes: int) -> dict | None:
    return _write_and_read(path, how, _detections(dist.get_rank(), dist.get_world_size(), boxes))


def case_masks(path: str, how: str) -> dict | None:
    """Instance masks ``[n, 1, s, s]`` of one image per filename, of two sizes: 64 px (3 and 4 objects), 96 px (5)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    images = [(64, 3), (64, 4), (96, 5), (96, 5)]
    batches = [
        ([f"img{i}.jpg"], [0], [{"boxes": torch.rand(n, 4), "masks": torch.rand(n, 1, s, s) > 0.5}])
        for i, (s, n) in enumerate(images)
        if i % world == rank
    ]
    return _write_and_read(path, how, batches)
