"""Ranks of tests/test_dict_rows.py: a dict of large frames, each a tensor of its own, gathered, checked on rank 0."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tdgather

SHAPE = (3, 128, 96)  # 36,864 elements: 36 KiB (bool, uint8) to 144 KiB (float32) a frame, each held alone


def frames_of(rank: int, dtype: torch.dtype, seed: int) -> dict[str, list]:
    """Rank ``rank``'s dict: 5 files, frames out of order, interleaved with other ranks'; three kinds of tensor.

    A frame is a tensor of its own, a row of a batch (a contiguous view of a larger storage), or a
    column of one (not contiguous): every kind the seed's loop can leave in the dict.
    """
    g = torch.Generator().manual_seed(seed * 100 + rank)
    batch = torch.randint(0, 256, (6, *SHAPE), generator=g, dtype=torch.uint8)
    out: dict[str, list] = {}
    for k in range(5):
        idx = torch.randperm(12, generator=g)[:6] * 4 + rank  # each rank its own frame indexes of the file
        for n, i in enumerate(idx.tolist()):
            raw = torch.randint(0, 256, SHAPE, generator=g, dtype=torch.uint8)
            kind = (k + n) % 3
            frame = raw if kind == 0 else batch[n].copy_(raw)[...] if kind == 1 else _column(raw)
            out.setdefault(f"clip_{k}.mp4", []).append((i, _as(frame, dtype)))
    return out


def _column(raw: torch.Tensor) -> torch.Tensor:
    """``raw``'s values in a non-contiguous view (a column of a wider tensor)."""
    wide = torch.zeros(raw.shape[0], raw.shape[1], raw.shape[2] * 2, dtype=raw.dtype)
    wide[:, :, ::2] = raw
    return wide[:, :, ::2]


def _as(frame: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The frame's bytes read as ``dtype`` (bool: each byte 0 or 1), same shape; a view where the layout allows."""
    if dtype is torch.bool:
        return frame.remainder(2).bool()
    if dtype.itemsize == 1:
        return frame.view(dtype) if frame.is_contiguous() else frame.contiguous().view(dtype)
    return frame.to(torch.float32).to(dtype)


def expected(world: int, dtype: torch.dtype, seed: int) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Every rank's frames, per filename sorted by frame_idx, stacked: what the gather must give."""
    merged: dict[str, list] = {}
    for rank in range(world):
        for name, pairs in frames_of(rank, dtype, seed).items():
            merged.setdefault(name, []).extend(pairs)
    out = {}
    for name, pairs in merged.items():
        pairs.sort(key=lambda p: p[0])
        out[name] = ([i for i, _ in pairs], torch.stack([f for _, f in pairs]))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def case_gather(dtype_name: str, seed: int) -> dict | None:
    """Every rank gathers its dict; rank 0 compares each filename with `expected`, bit for bit."""
    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    got = tdgather.gather(frames_of(rank, dtype, seed))
    if rank != 0:
        return None
    want = expected(world, dtype, seed)
    wrong = [
        name
        for name, (idx, frames) in want.items()
        if got[name].frame_idx.tolist() != idx or not same_bits(got[name].frames, frames)
    ]
    return {"files": sorted(got), "wrong": wrong}
