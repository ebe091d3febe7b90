"""``tdgather demo``: a small real inference job on a local CPU world.

Every rank runs the same small convolutional network over its share of a set
of synthetic videos (dense maps, and detections whose number changes from frame
to frame) and hands each batch's outputs to a `tdgather.Collector`,
which streams them to rank 0 while the loop runs; rank 0 writes the dataset.
The frames are spread unevenly over the ranks, out of order, and the last rank
holds nothing.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..api.collector import Collector
from .launch import run_local_world

__all__ = ["DEMO_MARK", "DemoNet", "assignment", "check_demo_output", "run_demo", "video_frames"]

DEMO_MARK = "tdgather_demo"  # in the index metadata of a dataset the demo wrote


class DemoNet(nn.Module):
    """A small network: per frame a depth map, a segmentation, and a varying number of detections."""

    GRID = 8  # the detector's anchors: one box per cell of a GRID x GRID grid

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
        )
        self.depth = nn.Conv2d(32, 1, 1)
        self.seg = nn.Conv2d(32, classes, 1)
        self.objectness = nn.Conv2d(32, 1, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Return ``{"depth": float32[B, 1, H/2, W/2], "seg": uint8[B, H/2, W/2], "boxes", "scores"}``.

        ``boxes`` (float32 ``[N_i, 4]``, x0 y0 x1 y1 in pixels) and ``scores`` (float32 ``[N_i]``) are
        jagged nested tensors: a toy detector keeps the grid cells whose objectness stands out in
        their frame (more than one standard deviation above its mean), so ``N_i`` varies, 0 included.
        """
        h = self.body(x)
        cells = nn.functional.adaptive_avg_pool2d(self.objectness(h), self.GRID).flatten(1)  # [B, GRID * GRID]
        z = (cells - cells.mean(1, keepdim=True)) / cells.std(1, keepdim=True)
        keep = z > 1.0
        frame, cell = keep.nonzero(as_tuple=True)  # row-major: frame by frame
        step = x.shape[-1] / self.GRID
        corner = torch.stack([cell % self.GRID, cell // self.GRID], 1).float() * step
        offsets = torch.cat([keep.new_zeros(1, dtype=torch.int64), keep.sum(1).cumsum(0)])
        return {
            "depth": self.depth(h).sigmoid(),
            "seg": self.seg(h).argmax(1).to(torch.uint8),
            "boxes": torch.nested.nested_tensor_from_jagged(torch.cat([corner, corner + step], 1), offsets),
            "scores": torch.nested.nested_tensor_from_jagged(z[frame, cell].sigmoid(), offsets),
        }


def video_frames(seed: int, video: int, frames: list[int], size: int) -> torch.Tensor:
    """Synthetic frames ``[len(frames), 3, size, size]`` of one video: a moving blob over noise."""
    g = torch.Generator().manual_seed(seed * 100_003 + video)
    base = torch.rand(3, size, size, generator=g)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    out = []
    for t in frames:
        cx, cy = (t * 3 + video * 7) % size, (t * 2 + video * 5) % size
        blob = torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * (size / 8) ** 2))
        out.append((base * 0.5 + blob).clamp(0, 1))
    return torch.stack(out)


def assignment(seed: int, lengths: list[int], world_size: int) -> list[list[tuple[int, int]]]:
    """Spread every ``(video, frame)`` over the ranks: shuffled, uneven, the last rank empty."""
    g = torch.Generator().manual_seed(seed)
    pairs = [(v, t) for v, n in enumerate(lengths) for t in range(n)]
    pairs = [pairs[i] for i in torch.randperm(len(pairs), generator=g).tolist()]
    if world_size == 1:
        return [pairs]
    weights = list(range(1, world_size)) + [0]
    total = sum(weights)
    bounds = [round(len(pairs) * sum(weights[:r]) / total) for r in range(world_size + 1)]
    return [pairs[bounds[r] : bounds[r + 1]] for r in range(world_size)]


def _rank_job(cfg: dict[str, Any]) -> dict[str, Any] | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg["seed"])
    model = DemoNet().eval()
    mine = assignment(cfg["seed"], cfg["lengths"], world)[rank]
    t0 = time.perf_counter()
    demo = {DEMO_MARK: True}  # so that `tdgather demo --out` replaces only a dataset the demo wrote
    with Collector(cfg["out"], overwrite=True, timeout=cfg["timeout"], progress=False, metadata=demo) as col:
        with torch.inference_mode():
            for i in range(0, len(mine), cfg["batch"]):
                batch = mine[i : i + cfg["batch"]]
                x = torch.cat([video_frames(cfg["seed"], v, [t], cfg["size"]) for v, t in batch])
                col.add([f"video_{v:04d}.mp4" for v, _ in batch], [t for _, t in batch], model(x))
        loop_end = time.perf_counter()
    s = col.summary
    if s is None:
        return None
    return {
        "frames": s.frames,
        "bytes": s.bytes,
        "filenames": len(cfg["lengths"]),
        "frames_per_rank": s.frames_per_rank,
        "duplicates_dropped": s.duplicates_dropped,
        "loop_seconds": loop_end - t0,
        "close_seconds": s.close_seconds,
        "seconds": s.seconds,
        "shards": s.shards,
    }


def check_demo_output(out: str) -> None:
    """Refuse an output that holds a tdgather dataset the demo did not write (the demo replaces only its own)."""
    from ..errors import OutputError
    from ..storage.location import local_path
    from ..storage.outdir import INDEX_NAME
    from ..storage.reader import open_dataset

    meta = open_dataset(out).metadata if (local_path(out) / INDEX_NAME).is_file() else None
    if meta is not None and not (meta.get("user", {}).get(DEMO_MARK) or meta.get(DEMO_MARK)):  # top level: older
        raise OutputError(
            f"output {out!r} holds a tdgather dataset that the demo did not write; the demo replaces only its own "
            "output: pass another --out"
        )


def run_demo(
    world_size: int = 4,
    videos: int = 12,
    max_frames: int = 40,
    size: int = 64,
    batch: int = 16,
    out: str = "out/demo",
    seed: int = 0,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Run the demo job on a local world and return rank 0's summary (plus wall seconds)."""
    check_demo_output(str(out))
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, max_frames // 5), max_frames + 1, (videos,), generator=g).tolist()
    cfg = {"seed": seed, "lengths": lengths, "size": size, "batch": batch, "out": str(out), "timeout": timeout}
    t0 = time.perf_counter()
    summary = run_local_world(_rank_job, world_size, cfg, timeout=timeout)[0]
    summary["wall_seconds"] = time.perf_counter() - t0
    summary["out"] = str(out)
    summary["world_size"] = world_size
    summary["videos"] = videos
    return summary
