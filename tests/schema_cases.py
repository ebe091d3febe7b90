"""World cases for one type per leaf name, decided by every frame of the dataset (tests/test_schema.py).

Each rank predicts its share of a job as a real model's outputs look: prompts of one frame each
(ragged tokens and a text), a detector that finds nothing, a detector that always finds exactly
100 boxes. Rank 0 saves (through `gather` + `save`, or a `Collector`), reads the dataset back and
returns what a user's reading code meets: the leaves read as ragged, each filename's leaf type,
`padded`, and `to_hf` where ``datasets`` is installed.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

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
    }
    first = ds[next(iter(ds))].frames
    if "boxes" in first.keys():
        padded, lengths = tdgather.padded(first["boxes"])
        out["padded"] = [list(padded.shape), lengths.tolist()]
    if importlib.util.find_spec("datasets") is not None:
        hf = ds.to_hf()
        out["hf_rows"] = len(hf)
        out["hf_first"] = {k: (len(v) if isinstance(v, list) else v) for k, v in hf[0].items() if k != "filename"}
    return out


def _write_and_read(path: str, how: str, batches: list[tuple[list[str], list | torch.Tensor, list]]) -> dict | None:
    """``batches`` into a `FrameStore`, gathered and saved (``how="gather"``), or into a Collector; rank 0 reads."""
    if how == "gather":
        store = tdgather.FrameStore()
        for names, idx, values in batches:
            store.add(names, idx, values)
        got = tdgather.gather(store)
        if got is None:
            return None
        tdgather.save(got, path)
    else:
        with tdgather.Collector(path) as col:
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
