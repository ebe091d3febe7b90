"""The safetensors codec: a shard's bytes written from its pieces, and read back from any byte source.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range; ``__metadata__``: str -> str), then the tensors' bytes. This module is the
one place tdgather writes or reads that layout:

- `encode` yields a file's bytes in pieces, never staged whole in memory: the header, then each
  tensor's bytes as views of the pieces it is made of (received buffers, or `tdgather.core.merge.Rows`);
- `SafetensorsFile` reads one from a `ByteSource` (a mapped local file, an object read by ranges,
  bytes in memory): it reads the header, checks every tensor's dtype, shape and byte range against
  the source's size before anything is read through it, and reads rows ``lo:hi`` of a tensor on asking.

A source that is ``mapped`` hands out views of memory it holds: a tensor is then a view of the whole
tensor's bytes, and its rows are views of that (as ``safetensors.safe_open`` gives them). Any other
source is read by one byte range per call, for the rows asked for only.

>>> data = b"".join(encode([("x", torch.int32, (2, 2), [torch.arange(4, dtype=torch.int32)])], {"k": "v"}))
>>> f = SafetensorsFile(BytesSource(data))
>>> f.keys(), f.metadata(), f.get_slice("x").get_shape(), f.get_slice("x")[1:2].tolist()
(['x'], {'k': 'v'}, [2, 2], [[2, 3]])
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ..core.dtypes import SAFETENSORS_CODE
from ..core.merge import Rows
from ..errors import DatasetError

__all__ = ["HEADER_MAX", "ByteSource", "BytesSource", "SafetensorsFile", "TensorSlice", "encode"]

HEADER_MAX = 100_000_000  # safetensors' own limit on a header
_DTYPE = {code: dtype for dtype, code in SAFETENSORS_CODE.items()}


class ByteSource(Protocol):
    """The bytes of one file, read by ranges (`tdgather.storage.store.Store.open`; its snapshot rules are there).

    ``where`` names it in messages; ``mapped``: ``read`` returns views of memory the source holds,
    so reading costs no copy and a large range is as cheap as a small one.
    """

    where: str
    size: int
    mapped: bool

    def read(self, start: int, end: int) -> bytes | bytearray | memoryview:
        """Bytes ``start:end``, all of them (``0 <= start <= end <= size``), or a `DatasetError`."""


class BytesSource:
    """Bytes in memory as a `ByteSource` (a file read whole, a test's bytes)."""

    mapped = True

    def __init__(self, data: bytes | bytearray | memoryview, where: str = "<bytes>") -> None:
        self._view = memoryview(bytearray(data))  # writable: a tensor made over it owns no read-only memory
        self.size, self.where = len(self._view), where

    def read(self, start: int, end: int) -> memoryview:
        """A view of bytes ``start:end``."""
        return self._view[start:end]


def encode(entries: list[tuple[str, torch.dtype, tuple, list]], metadata: dict[str, str]) -> Iterator:
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
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
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


class SafetensorsFile:
    """A safetensors file read from a `ByteSource`, with the calls of ``safetensors.safe_open``.

    Opening reads the header length and the header, and checks every tensor's entry (a known dtype,
    a shape of non-negative ints, a byte range inside the file of exactly its bytes); a `DatasetError`
    names the file and what is wrong. ``get_slice(name)[lo:hi]`` then reads rows ``lo:hi``.
    """

    def __init__(self, source: ByteSource) -> None:
        self.source = source
        where = source.where
        size = source.size
        if size < 8:
            raise _unreadable(where, f"{size} bytes (its header's length takes 8)")
        (n,) = struct.unpack("<Q", bytes(source.read(0, 8)))
        if n > min(HEADER_MAX, size - 8):
            raise _unreadable(where, f"a header of {n} bytes in a file of {size} bytes")
        try:
            header = json.loads(bytes(source.read(8, 8 + n)))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _unreadable(where, f"a header that is not JSON ({e})") from e
        if not isinstance(header, dict):
            raise _unreadable(where, f"a header that is a JSON {type(header).__name__}, not an object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise _unreadable(where, "a __metadata__ that is not str -> str")
        self._meta: dict[str, str] = meta
        self._base = 8 + n
        self._tensors = {key: _entry(where, key, desc, size - self._base) for key, desc in header.items()}
        self._whole: dict[str, torch.Tensor] = {}  # a mapped source's tensors, viewed once

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def metadata(self) -> dict[str, str]:
        """The header's ``__metadata__``."""
        return dict(self._meta)

    def keys(self) -> list[str]:
        """The tensor names, sorted."""
        return sorted(self._tensors)

    def get_slice(self, key: str) -> TensorSlice:
        """A tensor, unread: its dtype and shape, and rows read on indexing."""
        if key not in self._tensors:
            raise DatasetError(self.source.where, "header", f"expected a tensor {key!r}, got none")
        return TensorSlice(self, key)

    def get_tensor(self, key: str) -> torch.Tensor:
        """A whole tensor."""
        return self.get_slice(key)[:]

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (clamped to the tensor) of ``key``: a view of a mapped source, else one byte range read."""
        code, shape, start, end = self._tensors[key]
        n = shape[0] if shape else 1
        lo, hi = max(0, min(lo, n)), max(0, min(hi, n))
        hi = max(lo, hi)
        if self.source.mapped:
            whole = self._whole.get(key)
            if whole is None:
                whole = self._whole[key] = _tensor(self.source.read(self._base + start, self._base + end), code, shape)
            return whole[lo:hi] if shape else whole
        row = (end - start) // n if n else 0
        data = self.source.read(self._base + start + lo * row, self._base + start + hi * row)
        return _tensor(bytearray(data), code, [hi - lo, *shape[1:]] if shape else shape)


class TensorSlice:
    """One tensor of a `SafetensorsFile`: ``get_dtype()``, ``get_shape()``, ``[lo:hi]`` on its first dimension."""

    def __init__(self, file: SafetensorsFile, key: str) -> None:
        self.file, self.key = file, key

    def get_dtype(self) -> str:
        """The safetensors dtype code (``"F32"``)."""
        return self.file._tensors[self.key][0]

    def get_shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self.file._tensors[self.key][1])

    def __getitem__(self, index: Any) -> torch.Tensor:
        shape = self.file._tensors[self.key][1]
        if not shape:
            return self.file.rows(self.key, 0, 1)
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"a safetensors tensor is read by a slice of rows lo:hi, got {index!r}")
        lo, hi, _ = index.indices(shape[0])
        return self.file.rows(self.key, lo, hi)


def _entry(where: str, key: str, desc: Any, data: int) -> tuple[str, list[int], int, int]:
    """One header entry, checked: its dtype code, shape and byte range inside the ``data`` bytes after the header."""
    if not isinstance(desc, dict) or set(desc) != {"dtype", "shape", "data_offsets"}:
        raise _unreadable(where, f"the entry {key!r}: {desc!r} (expected dtype, shape, data_offsets)"[:300])
    code, shape, offsets = desc["dtype"], desc["shape"], desc["data_offsets"]
    ok = (
        isinstance(code, str)
        and code in _DTYPE
        and isinstance(shape, list)
        and all(type(d) is int and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
    )
    if not ok or not 0 <= offsets[0] <= offsets[1] <= data:
        raise _unreadable(where, f"the entry {key!r}: {desc} (expected a dtype, a shape, a range in 0..{data})"[:300])
    numel = 1
    for d in shape:
        numel *= d
    if offsets[1] - offsets[0] != numel * _DTYPE[code].itemsize:
        raise _unreadable(where, f"the entry {key!r}: {desc} (expected the bytes of {numel} {code} values)"[:300])
    return code, shape, offsets[0], offsets[1]


def _unreadable(where: str, got: str) -> DatasetError:
    return DatasetError(where, "header", f"expected a readable safetensors file, got {got}")


def _tensor(data: bytes | bytearray | memoryview, code: str, shape: list[int]) -> torch.Tensor:
    """A tensor of ``code`` and ``shape`` over ``data`` (not copied)."""
    dtype = _DTYPE[code]
    out = torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)
    return out.reshape(shape)
