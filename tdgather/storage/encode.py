"""A shard's bytes: a safetensors file streamed from its pieces, never staged whole in memory.

`safetensors_chunks` yields the 8-byte header length, the JSON header, then each tensor's bytes
as views of the pieces it is made of (received buffers, or `tdgather.core.merge.Rows` to gather):
the store writes them as they come (`tdgather.storage.store`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import torch

from ..core.dtypes import SAFETENSORS_CODE
from ..core.merge import Rows

__all__ = ["safetensors_chunks"]


def safetensors_chunks(entries: list[tuple[str, torch.dtype, tuple, list]], metadata: dict[str, str]) -> Iterator:
    """A safetensors file's bytes, in pieces.

    Args:
        entries: ``(name, dtype, shape, pieces)``; the pieces (tensors, or `tdgather.core.merge.Rows`),
            concatenated on dim 0, make the tensor.
        metadata: str -> str, stored as ``__metadata__``.
    """
    entries = sorted(entries, key=lambda e: -e[1].itemsize)  # keeps every tensor aligned to its itemsize
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, _ in entries:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": SAFETENSORS_CODE[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    yield struct.pack("<Q", len(raw)) + raw
    for _, _, _, pieces in entries:
        yield from _byte_views(pieces)


def _byte_views(pieces: list) -> list[memoryview]:
    """The pieces' bytes in order: neighbours in one storage (or one `Rows`) joined into one view."""
    out: list = []
    for piece in pieces:
        if not len(piece):
            continue
        if isinstance(piece, Rows):
            if out and isinstance(out[-1], Rows) and piece.follows(out[-1]):
                piece = Rows(piece.sources, piece.src, piece.row, out.pop().lo, piece.hi)
            out.append(piece)
            continue
        b = piece.detach().cpu().contiguous().view(-1).view(torch.uint8)
        last = out[-1] if out and isinstance(out[-1], torch.Tensor) else None
        if last is not None and last.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
            if last.storage_offset() + last.numel() == b.storage_offset():
                out[-1] = torch.empty(0, dtype=torch.uint8).set_(
                    last.untyped_storage(), last.storage_offset(), (last.numel() + b.numel(),)
                )
                continue
        out.append(b)
    views: list[memoryview] = []
    for x in out:
        views += x.byte_views() if isinstance(x, Rows) else [memoryview(x.numpy())]
    return views
