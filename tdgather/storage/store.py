"""`Store`: the place a dataset's files are kept, as the readers and writers see it. The storage seam.

Everything tdgather reads or writes goes through a `Store`, one directory (or object prefix) at a
time: list what is there, read a file or a byte range of it, open a shard's safetensors header,
put a file atomically (a whole object or nothing), remove one by name. Two implementations:

- `LocalStore`: a directory on a local or mounted filesystem; files are written to a temporary
  name, fsynced and renamed into place (`tdgather.storage.atomic.LocalFS`), shards are mapped;
- `tdgather.storage.objects.ObjectStore`: an fsspec URL (``s3://``, ``gs://``, ``az://``,
  ``memory://``, ...); an object is put whole or not at all, shards are read by byte ranges.

`tdgather.storage.location.store_at(path, storage_options)` picks one for a path or URL.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from safetensors import SafetensorError, safe_open

from ..errors import DatasetError
from .atomic import LocalFS

__all__ = ["LocalStore", "Store", "Written", "hashed"]


class Written(NamedTuple):
    """A file as it was put: its size in bytes and the sha256 of those bytes (hex; None where not computed)."""

    size: int
    sha256: str | None

    def entry(self) -> dict:
        """The keys the index lists for a shard: ``size``, and ``sha256`` where it was computed."""
        return {"size": self.size} if self.sha256 is None else {"size": self.size, "sha256": self.sha256}


class Store(Protocol):
    """One directory of a dataset's files, local or in an object store.

    ``where`` names it in messages (a path or a URL); ``path(name)`` names one file in it. Names
    are plain file names (no directory); the callers check them (`tdgather.format.names`).
    """

    where: str
    local: bool  # files are renamed into place, and a directory can be staged beside it

    def path(self, name: str) -> str:
        """One file of the store, as messages name it."""

    def list(self) -> dict[str, int]:
        """Every file in the store, and below it (as ``sub/name``), with its size in bytes."""

    def size(self, name: str) -> int | None:
        """A file's size, or None where it is not there (or not a regular file)."""

    def read(self, name: str) -> bytes:
        """A whole file (an index, a record)."""

    def open_safetensors(self, name: str) -> Any:
        """A shard opened for reading, with the calls of ``safetensors.safe_open``; raises `DatasetError`."""

    def digest(self, name: str) -> Written:
        """A file's size and sha256, reading it whole."""

    def put(self, name: str, chunks: Iterable, then: Callable[[Callable[[], None]], None] | None = None) -> Written:
        """Write a file from its chunks, atomically; with ``then``, the last step may be handed to it."""

    def remove(self, name: str) -> None:
        """Remove one file by name (absent: nothing happens)."""


def hashed(chunks: Iterable, digest: Any, count: list[int]) -> Iterator:
    """``chunks`` as they are, each added to ``digest`` (a hashlib object, or None) and its length to ``count[0]``."""
    for chunk in chunks:
        if digest is not None:
            digest.update(chunk)
        count[0] += len(chunk)
        yield chunk


class LocalStore:
    """A directory on a local (or mounted) filesystem: files renamed into place, shards mapped.

    Only files directly in the directory are opened; a link is followed only to a file in it.
    ``checksums``: ``put`` computes each file's sha256 as it writes it. Off by default: hashing
    costs more than writing to the page cache (docs/object-storage.md has the figures), and a
    local write is already atomic and durable; sizes are always recorded.
    """

    local = True

    def __init__(self, root: str | os.PathLike, fs: LocalFS | None = None, checksums: bool = False) -> None:
        self.root = Path(root)
        self.where = str(self.root)
        self.fs = fs or LocalFS()
        self.checksums = checksums

    def path(self, name: str) -> str:
        """``root/name``."""
        return str(self.root / name)

    def list(self) -> dict[str, int]:
        """The regular files directly in the directory, with their sizes ({} when it is not one).

        A file renamed or removed while the directory is read (another writer's temporary file, put
        in place under its final name) is left out, as if it had gone a moment earlier.
        """
        if not self.root.is_dir():
            return {}
        out = {}
        for entry in os.scandir(self.root):
            try:
                if entry.is_file(follow_symlinks=False):
                    out[entry.name] = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
        return out

    def size(self, name: str) -> int | None:
        """The size of a regular file directly in the directory, else None."""
        path = self.root / name
        return path.stat().st_size if path.is_file() else None

    def read(self, name: str) -> bytes:
        """The whole file, refusing a link that leads out of the directory."""
        self._inside(name)
        return (self.root / name).read_bytes()

    def _inside(self, name: str) -> str:
        """The real path of ``name``, checked to be a regular file directly in the directory."""
        path = self.root / name
        real = os.path.realpath(path)
        if os.path.dirname(real) != os.path.realpath(self.root):
            raise DatasetError(str(path), "file", f"expected a file in the dataset directory, got a link to {real!r}")
        if not os.path.isfile(real):  # missing, or a directory, FIFO or device: never opened
            got = (
                "something else (a directory, FIFO or device)"
                if os.path.exists(real)
                else "no such file (was the dataset rewritten or moved since it was opened? open it again)"
            )
            raise DatasetError(str(path), "file", f"expected a regular file, got {got}")
        return real

    def open_safetensors(self, name: str) -> Any:
        """``safe_open`` on the file, which maps it: it reads those bytes even after the name is replaced."""
        real = self._inside(name)
        try:
            return safe_open(real, framework="pt")
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise DatasetError(self.path(name), "header", f"expected a readable safetensors file, got {e}") from e

    def digest(self, name: str) -> Written:
        """Size and sha256 of the file, read through a mapping."""
        real = self._inside(name)
        h = hashlib.sha256()
        with open(real, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size:
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    h.update(m)
        return Written(size, h.hexdigest())

    def put(self, name: str, chunks: Iterable, then: Callable[[Callable[[], None]], None] | None = None) -> Written:
        """Write through `LocalFS.write_atomic` (temporary name, fsync, rename, fsync the directory)."""
        h, count = (hashlib.sha256() if self.checksums else None), [0]
        self.fs.write_atomic(self.root / name, hashed(chunks, h, count), then)
        return Written(count[0], None if h is None else h.hexdigest())

    def remove(self, name: str) -> None:
        """Unlink the file, if it is there."""
        (self.root / name).unlink(missing_ok=True)
