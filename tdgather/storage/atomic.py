"""Atomic, durable file writes: `LocalFS`, the seam every file tdgather writes goes through.

A file is written to a temporary name in its directory, fsynced, renamed into place, and the
directory fsynced, so a crash leaves the old state or the new one, never a partial file under
a final name. A safetensors shard is streamed from its pieces (views of received buffers, or
rows to gather) straight into ``writev``: no staging copy of the whole file is made.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..core.dtypes import SAFETENSORS_CODE
from ..core.merge import Rows
from ..errors import OutputError
from .outdir import exchange, fsync_dir

__all__ = ["LocalFS"]

_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)
# bytes gathered before one writev: views of buffers cost nothing to hold, but the index is
# made as it is written, so its pieces are held only this long
_BATCH_BYTES = 4 << 20


class LocalFS:
    """How a dataset's files reach a local disk: each one atomic and durable. The storage seam.

    Every file tdgather writes goes through one of these (`DatasetWriter(fs=...)`):

    1. ``write_safetensors`` / ``write_atomic``: the bytes to a temporary name beside the file,
       gathered into few ``writev`` calls (``write_all``);
    2. then ``fsync``, ``replace`` (the rename into place) and ``fsync_dir``, on the caller's thread
       or handed to ``then`` to run later;
    3. ``exchange``: an old dataset directory swapped with the new one in one step (`publish`).

    A subclass may count, delay or fail any step (the fault tests do): the rest of tdgather sees
    only these calls.
    """

    def fsync(self, fd: int) -> None:
        """Make a file's bytes durable."""
        os.fsync(fd)

    def replace(self, src: Path, dst: Path) -> None:
        """Rename ``src`` to ``dst`` (replacing it), atomically."""
        os.replace(src, dst)

    def fsync_dir(self, path: Path) -> None:
        """Make a directory's entries durable."""
        fsync_dir(path)

    def exchange(self, a: Path, b: Path) -> bool:
        """Swap two directories atomically; False where the system cannot."""
        return exchange(a, b)

    def write_safetensors(
        self,
        path: Path,
        entries: list[tuple[str, torch.dtype, tuple, list]],
        metadata: dict[str, str],
        then: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """Write a safetensors file atomically, streaming each tensor from its pieces (no staging copy).

        Args:
            path: the final file name; a temporary name beside it is written first.
            entries: ``(name, dtype, shape, pieces)``; the pieces (tensors, or `tdgather.core.merge.Rows`),
                concatenated on dim 0, make the tensor.
            metadata: str -> str, stored as ``__metadata__``.
            then: given, the last step (fsync, rename into place, fsync the directory) is handed to it
                to run later, for example on another thread; else it runs before this returns.
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

        def chunks():
            yield struct.pack("<Q", len(raw)) + raw
            for _, _, _, pieces in entries:
                yield from _byte_views(pieces)

        self.write_atomic(path, chunks(), then)

    def write_all(self, fd: int, chunks: Iterable) -> None:
        """Write every chunk in order, gathered into few ``writev`` calls."""
        batch: list = []
        size = 0
        for chunk in chunks:
            batch.append(chunk)
            size += len(chunk)
            if len(batch) >= _IOV_MAX or size >= _BATCH_BYTES:
                self.writev(fd, batch)
                batch, size = [], 0
        self.writev(fd, batch)


    def writev(self, fd: int, views: list) -> None:
        """One ``os.writev`` after another until every view is written (a short write resumes inside its buffer)."""
        k = 0
        while k < len(views):
            n = os.writev(fd, views[k : k + _IOV_MAX])
            while k < len(views) and n >= len(views[k]):
                n -= len(views[k])
                k += 1
            if n:  # a short write stopped inside this buffer
                views[k] = memoryview(views[k])[n:]


    def write_atomic(self, path: Path, chunks: Any, then: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Write ``chunks`` to a temporary name beside ``path``, then fsync it, rename it and fsync the directory.

        With ``then``, that last step is handed to it instead of run here (see `LocalFS.write_safetensors`).
        """
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise OutputError(f"writing {str(path)!r} failed ({e}); files already committed stay valid") from e
        try:
            self.write_all(fd, chunks)
        except BaseException as e:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise OutputError(f"writing {str(path)!r} failed ({e}); files already committed stay valid") from e
            raise

        def finish() -> None:
            try:
                try:
                    self.fsync(fd)
                finally:
                    os.close(fd)
                self.replace(tmp, path)
                self.fsync_dir(path.parent)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise OutputError(f"writing {str(path)!r} failed ({e}); files already committed stay valid") from e
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

        if then is None:
            finish()
        else:
            then(finish)


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
