"""The benchmark workloads, as per-rank batches of ``(filenames, frame_idx, frames)``.

Frames are assigned to ranks by global position: round-robin, as
``DistributedSampler`` does, except for ``skewed`` (rank 1 holds 70%, the last none).

- ``large``: 3x64x64 float32 frames, 629 MB in all, every video split over the ranks;
- ``large_whole``: the same frames, each video on one rank (a sampler over videos);
- ``tiny``: 400k frames of 16 float32;
- ``skewed``: 3x32x32 float32 frames, 246 MB, rank 1 holds 70%, the last rank none;
- ``per_image``: 20,000 images, one frame each (``image_00012.jpg``): float32[1000] class logits;
- ``mixed``: shapes and dtypes (float32, bfloat16, uint8, bool, float16, int16) differ by filename;
- ``detection``: a detector's output, from `benchmarks.detection`: per frame 0-50 ``boxes`` float32
  ``[N_i, 4]``, ``scores`` float32 ``[N_i]`` and ``labels`` int64 ``[N_i]`` (jagged nested tensors
  ``[B, j, ...]``), and ``feat`` float32 ``[256]``; round-robin, in batches of 32 frames, each a dict.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from . import detection

__all__ = ["WORKLOADS", "batches", "describe"]

# name -> (filenames, frames per filename)
WORKLOADS = {
    "large": (64, 200),
    "large_whole": (64, 200),
    "tiny": (4_000, 100),
    "skewed": (100, 200),
    "mixed": (600, 20),
    "per_image": (20_000, 1),
    "detection": (100, detection.PER_VIDEO),  # 17 MB: gather_object takes ~3.5 s a call on 2 cores
}
_MIXED = [
    (torch.float32, (3, 32, 32)),
    (torch.bfloat16, (8, 24)),
    (torch.uint8, (3, 64, 64)),
    (torch.bool, (64, 64)),
    (torch.float16, (17,)),
    (torch.int16, (5, 5)),
]


def _spec(name: str, file: int) -> tuple[torch.dtype, tuple[int, ...]]:
    if name in ("large", "large_whole"):
        return torch.float32, (3, 64, 64)
    if name == "tiny":
        return torch.float32, (16,)
    if name == "skewed":
        return torch.float32, (3, 32, 32)
    if name == "per_image":
        return torch.float32, (1000,)
    return _MIXED[file % len(_MIXED)]


def _frames(dtype: torch.dtype, shape: tuple[int, ...], n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand((n, *shape), generator=g)
    if dtype == torch.bool:
        return x > 0.5
    if not dtype.is_floating_point:
        return (x * 100).to(dtype)
    return x.to(dtype)


def _owner(name: str, positions: torch.Tensor, total: int, world: int, per_file: int) -> torch.Tensor:
    if name == "large_whole":  # whole videos per rank, as a sampler over videos gives
        return (positions // per_file) % world
    if name != "skewed" or world == 1:
        return positions % world
    # rank 1 holds the first 70%; the rest goes round-robin to rank 0 and the middle ranks;
    # the last rank holds nothing (with two ranks, rank 0 takes the rest)
    cut = int(total * 0.7)
    others = torch.tensor([0, *range(2, world - 1)]) if world > 2 else torch.tensor([0])
    rest = others[(positions - cut) % others.numel()]
    return torch.where(positions < cut, torch.ones_like(positions), rest)


def batches(
    name: str, rank: int, world: int, batch: int = 64, scale: float = 1.0
) -> Iterator[tuple[list[str], torch.Tensor, torch.Tensor | dict]]:
    """Yield rank ``rank``'s frames of a workload in inference-sized batches, grouped by layout.

    ``scale`` shrinks the number of filenames (the ``--quick`` preset uses 0.1). ``detection``
    yields its own batches of 32 frames (``batch`` is not used), their frames a dict.
    """
    files, per_file = WORKLOADS[name]
    files = max(1, round(files * scale))
    if name == "detection":
        yield from detection.batches(files, rank, world)
        return
    total = files * per_file
    positions = torch.arange(total)
    mine = positions[_owner(name, positions, total, world, per_file) == rank]
    file_of, idx_of = mine // per_file, mine % per_file
    if name == "mixed":  # one layout per batch, as one model head would produce
        order = torch.argsort(file_of % len(_MIXED), stable=True)
        file_of, idx_of = file_of[order], idx_of[order]
    start = 0
    while start < mine.numel():
        stop = min(start + batch, mine.numel())
        kind = int(file_of[start]) % len(_MIXED) if name == "mixed" else 0
        if name == "mixed":
            same = (file_of[start:stop] % len(_MIXED)) == kind
            stop = start + int(same.int().cumprod(0).sum())
        dtype, shape = _spec(name, int(file_of[start]))
        names = [_filename(name, int(f)) for f in file_of[start:stop]]
        yield names, idx_of[start:stop].clone(), _frames(dtype, shape, stop - start, seed=rank * 1_000_003 + start)
        start = stop


def _filename(name: str, file: int) -> str:
    """A file's name: ``large_00012.mp4``; a per_image workload's ``image_00012.jpg``."""
    return f"image_{file:05d}.jpg" if name == "per_image" else f"{name}_{file:05d}.mp4"


def describe(name: str, scale: float = 1.0) -> str:
    """One line for a report."""
    files, per_file = WORKLOADS[name]
    files = max(1, round(files * scale))
    if name == "mixed":
        return f"{files} filenames x {per_file} frames; {len(_MIXED)} dtype/shape kinds by filename"
    if name == "detection":
        return f"{files * per_file} frames of 0-50 boxes, scores, labels and a float32[{detection.FEAT}] embedding"
    dtype, shape = _spec(name, 0)
    nbytes = files * per_file * torch.Size(shape).numel() * dtype.itemsize
    frames = f"{str(dtype).removeprefix('torch.')}{list(shape)}, {nbytes / 1e6:.3g} MB"
    if name == "per_image":
        return f"{files} images, one frame each, {frames}"
    return f"{files * per_file} frames {frames}"
