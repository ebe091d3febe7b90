"""A layout's rows in the frame store: chunks of batches, and the open block small batches are copied into.

A batch to copy of up to 64 KiB is copied, frame indexes and frames, into its layout's open block
(one ``memmove`` each), after the batches before it; blocks double from 64 KiB to 4 MiB and are
sent as they are (`tdgather.comm.pack`). Other batches are chunks of their own. Only plain frame
indexes (`is_plain_index`) and contiguous CPU tensors whose bytes are their values (`unflagged`)
are copied this way.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import torch

from .frames import Layout

__all__ = ["ROW_ALONE", "Chunk", "LayoutGroup", "is_plain_index", "unflagged"]

_SMALL = 64 << 10  # a copied batch of at most this many bytes goes into its layout's open block
_BLOCK_MIN = 64 << 10  # a layout's first block; each next one twice as large, up to _BLOCK_MAX
_BLOCK_MAX = 4 << 20
ROW_ALONE = 32 << 10  # a dict's frame of at least this many bytes may be held as a chunk of its own (no stack)
_memmove = ctypes.memmove


@dataclass
class Chunk:
    """A chunk of one layout's rows, as `FrameStore.groups` gives it."""

    file_ids: torch.Tensor  # int64 [B]
    frame_idx: torch.Tensor  # int64 [B]
    tensors: list[Any]  # [B, *leaf.shape] on the CPU; a `Ragged` for a ragged leaf
    json: list[list]  # B values per JSON leaf


class LayoutGroup:
    """The rows of one layout, in the order added.

    Filenames wait in ``pending`` until `FrameStore._intern` gives them ids. Frame indexes and
    tensor leaves are chunks of rows (``idx[c]``, and ``chunks[c][j]`` for leaf ``j``), then rows
    ``start:fill`` of the open block (``block_idx``, ``block``), which small batches are copied into.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.pending: list[str] = []
        self.ids: list[torch.Tensor] = []  # file ids of the rows before the pending ones
        self.files: set[str] = set()  # the filenames of its rows
        self.json: list[list] = [[] for _ in layout.nontensor]
        self.idx: list[torch.Tensor] = []
        self.chunks: list[list[torch.Tensor]] = []
        self.leaf_bytes = [math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in layout.leaves]
        self.frame_nbytes = layout.frame_nbytes  # ragged leaves not counted: their values are, per batch
        # rows of a batch copied into the open block (layouts with a ragged leaf are kept as given)
        self.small = _SMALL // self.frame_nbytes if self.frame_nbytes and not layout.ragged else 0
        self.block_idx = torch.empty(0, dtype=torch.int64)
        self.block: list[torch.Tensor] = []
        self.idx_addr = 0
        self.addr: list[int] = []  # of the block's leaves
        self.start = self.fill = self.cap = 0

    def copy_in(self, idx: torch.Tensor, tensors: tuple | list, n: int) -> None:
        """Copy a batch of ``n`` rows (all contiguous on the CPU, indexes int64) into the open block."""
        if self.fill + n > self.cap:
            self.seal()
            size = max(_BLOCK_MIN, min(_BLOCK_MAX, 2 * self.cap * (8 + self.frame_nbytes)))
            self.cap = max(n, size // (8 + self.frame_nbytes))
            self.block_idx = torch.empty(self.cap, dtype=torch.int64)
            self.block = [torch.empty((self.cap, *leaf.shape), dtype=leaf.dtype) for leaf in self.layout.leaves]
            self.idx_addr, self.addr = self.block_idx.data_ptr(), [b.data_ptr() for b in self.block]
            self.start = self.fill = 0
        at = self.fill
        _memmove(self.idx_addr + 8 * at, idx.data_ptr(), 8 * n)
        for addr, size, t in zip(self.addr, self.leaf_bytes, tensors, strict=True):
            _memmove(addr + at * size, t.data_ptr(), n * size)
        self.fill = at + n

    def keep(self, idx: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Add a batch as a chunk of its own."""
        self.seal()
        self.idx.append(idx)
        self.chunks.append(tensors)

    def keep_rows(self, idx: torch.Tensor, frames: list[torch.Tensor]) -> None:
        """Add frames (tensors of this layout's one leaf, as the store keeps them) as chunks of one row each."""
        self.seal()
        self.idx += idx.split(1)
        self.chunks += [[t.unsqueeze(0)] for t in frames]

    def seal(self) -> None:
        """End the open block's chunk here (later batches start a new one)."""
        if self.fill > self.start:
            self.idx.append(self.block_idx[self.start : self.fill])
            self.chunks.append([b[self.start : self.fill] for b in self.block])
            self.start = self.fill


def is_plain_index(x: Any) -> bool:
    """Whether ``x`` is frame indexes that may be copied as they are: int64 ``[B]``, contiguous, CPU."""
    return (
        type(x) is torch.Tensor
        and x.is_cpu
        and x.dtype is torch.int64
        and x.dim() == 1
        and x.is_contiguous()
        and not x.is_neg()
    )


def unflagged(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are its values: no conjugate or negative bit."""
    return not (t.is_conj() or t.is_neg())
