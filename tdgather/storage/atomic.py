"""Atomic, durable file writes: `LocalFS`, the seam every local file tdgather writes goes through.

A file is written to a temporary name in its directory, fsynced, renamed into place, and the
directory fsynced, so a crash leaves the old state or the new one, never a partial file under
a final name. A shard's bytes (`tdgather.format.codec`) stream from its pieces straight into
``writev``: no staging copy of the whole file is made.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import OutputError
from .outdir import exchange, fsync_dir

__all__ = ["LocalFS", "final_name"]

_TEMPORARY = re.compile(r"\.(.+)\.tmp-[0-9]+")  # `LocalFS.write_atomic`'s temporary name for a file


def final_name(name: str) -> str:
    """The name a file written by `LocalFS.write_atomic` will have: ``name`` itself unless it is a temporary one.

    >>> final_name(".shard-00000.safetensors.tmp-4242"), final_name("shard-00000.safetensors")
    ('shard-00000.safetensors', 'shard-00000.safetensors')
    """
    m = _TEMPORARY.fullmatch(name)
    return m[1] if m else name


_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)
# bytes gathered before one writev: views of buffers cost nothing to hold, but the index is
# made as it is written, so its pieces are held only this long
_BATCH_BYTES = 4 << 20


class LocalFS:
    """How a dataset's files reach a local disk: each one atomic and durable. The storage seam.

    Every file tdgather writes goes through one of these (`DatasetWriter(fs=...)`):

    1. ``write_atomic``: the bytes to a temporary name beside the file, gathered into few
       ``writev`` calls (``write_all``);
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

        With ``then``, that last step is handed to it instead of run here (the writer hands it to its fsync thread).
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
