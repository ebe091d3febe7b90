"""Whole-row operations on ``[B, ...]`` tensors, bit-exact for every dtype (through integer views)."""

from __future__ import annotations

import math

import torch

__all__ = ["row_view", "run_start", "scatter_rows"]

_WIDTHS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _row_width(t: torch.Tensor) -> int:
    nbytes = math.prod(t.shape[1:]) * t.dtype.itemsize
    offset = t.storage_offset() * t.dtype.itemsize
    return next(w for w in _WIDTHS if nbytes % w == 0 and offset % w == 0 and (nbytes or w == 1))


def row_view(t: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """View ``[B, ...]`` as integer rows ``[B, k]``, bit-exact, as wide as the frame size allows.

    Copying, scattering and comparing whole rows through the widest integer view is
    dtype-agnostic (bool, float8, NaN bits) and fast. Only non-contiguous input is copied.

    >>> row_view(torch.ones(2, 3, dtype=torch.float16)).dtype, row_view(torch.ones(2, 2)).shape
    (torch.int16, torch.Size([2, 1]))
    """
    t = t.contiguous()
    width = width or _row_width(t)
    nbytes = math.prod(t.shape[1:]) * t.dtype.itemsize
    return t.view(-1).view(torch.uint8).view(_WIDTHS[width]).view(t.shape[0], nbytes // width)


def scatter_rows(dst: torch.Tensor, target: int | torch.Tensor, src: torch.Tensor) -> None:
    """Copy the rows of ``src`` into ``dst``: from row ``target`` on, or to the rows it lists."""
    src = src.contiguous()
    if isinstance(target, int):
        dst = dst[target : target + src.shape[0]]
    width = min(_row_width(dst), _row_width(src))
    if isinstance(target, int):
        row_view(dst, width).copy_(row_view(src, width))
    else:
        row_view(dst, width).index_copy_(0, target, row_view(src, width))


def run_start(positions: torch.Tensor) -> int | None:
    """The first position when ``positions`` is one increasing run (a plain copy will do), else None.

    >>> run_start(torch.tensor([4, 5, 6])), run_start(torch.tensor([4, 6]))
    (4, None)
    """
    if positions.numel() == 0:
        return 0
    first = int(positions[0])
    last = int(positions[-1])
    if last - first + 1 == positions.numel() and bool((positions.diff() == 1).all()):
        return first
    return None
