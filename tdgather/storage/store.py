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

import contextlib
import fcntl
import hashlib
import mmap
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from safetensors import SafetensorError, safe_open

from ..errors import DatasetError
from .atomic import LocalFS

__all__ = ["LocalStore", "Store", "Written", "crc32_of", "hashed"]


class Written(NamedTuple):
    """A file as it was put: its size in bytes, their sha256 (hex) and CRC-32 (each None where not computed)."""

    size: int
    sha256: str | None
    crc32: int | None = None

    def entry(self) -> dict:
        """The keys the index lists for a shard: ``size``, and ``sha256`` and ``crc32`` where they were computed."""
        out: dict = {"size": self.size}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        if self.crc32 is not None:
            out["crc32"] = self.crc32
        return out


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

    def digest(self, name: str, sha256: bool = True) -> Written:
        """A file's size, sha256 (unless not ``sha256``) and CRC-32, reading it whole."""

    def put(self, name: str, chunks: Iterable, then: Callable[[Callable[[], None]], None] | None = None) -> Written:
        """Write a file from its chunks, atomically; with ``then``, the last step may be handed to it."""

    def remove(self, name: str) -> None:
        """Remove one file by name (absent: nothing happens)."""

    def version(self, name: str) -> str | None:
        """A token that changes whenever the file is written again (an ETag, a stat); None where it is absent."""

    def put_if(self, name: str, data: bytes, expected: str | None) -> bool:
        """Write a small file whole only if its `version` is still ``expected`` (None: only if absent).

        The one commit step goes through this (`tdgather.storage.prefix`). Where the store can
        (S3's ``If-Match`` / ``If-None-Match``) the condition is the store's own; elsewhere it is
        checked just before the write. False when the file changed (another run committed): nothing
        was written.
        """


def hashed(chunks: Iterable, digest: Any, count: list[int]) -> Iterator:
    """``chunks`` as they are, each added to ``digest`` (a hashlib object, or None) and its length to ``count[0]``."""
    for chunk in chunks:
        if digest is not None:
            digest.update(chunk)
        count[0] += len(chunk)
        yield chunk


def crc32_of(chunks: Iterable, crc: list[int]) -> Iterator:
    """``chunks`` as they are, each added to the CRC-32 in ``crc[0]`` (zlib's: start it at 0)."""
    for chunk in chunks:
        crc[0] = zlib.crc32(chunk, crc[0])
        yield chunk


class LocalStore:
    """A directory on a local (or mounted) filesystem: files renamed into place, shards mapped.

    Only files directly in the directory are opened; a link is followed only to a file in it.
    ``put`` computes each file's CRC-32 as it writes it (the index lists it: ``verify()`` checks
    every byte against it). ``checksums``: its sha256 too. Off by default: hashing costs more than
    writing to the page cache (docs/object-storage.md has the figures); a CRC-32 costs a fraction.
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

    def digest(self, name: str, sha256: bool = True) -> Written:
        """Size, sha256 (unless not ``sha256``) and CRC-32 of the file, read through a mapping."""
        real = self._inside(name)
        h, crc = (hashlib.sha256() if sha256 else None), 0
        with open(real, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size:
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    if h is not None:
                        h.update(m)
                    crc = zlib.crc32(m)
        return Written(size, None if h is None else h.hexdigest(), crc)

    def put(self, name: str, chunks: Iterable, then: Callable[[Callable[[], None]], None] | None = None) -> Written:
        """Write through `LocalFS.write_atomic` (temporary name, fsync, rename, fsync the directory)."""
        h, count, crc = (hashlib.sha256() if self.checksums else None), [0], [0]
        self.fs.write_atomic(self.root / name, crc32_of(hashed(chunks, h, count), crc), then)
        return Written(count[0], None if h is None else h.hexdigest(), crc[0])

    def remove(self, name: str) -> None:
        """Unlink the file, if it is there."""
        (self.root / name).unlink(missing_ok=True)

    def version(self, name: str) -> str | None:
        """Inode, modification time and size: a file put again (renamed into place) has another."""
        try:
            st = os.stat(self.root / name, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"

    def put_if(self, name: str, data: bytes, expected: str | None) -> bool:
        """Under an exclusive lock on the directory: check the version, then put (temporary name, rename)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with contextlib.suppress(OSError):  # a filesystem without locks: checked, unlocked
                fcntl.flock(fd, fcntl.LOCK_EX)
            if self.version(name) != expected:
                return False
            self.put(name, [data])
            return True
        finally:
            os.close(fd)  # releases the lock
