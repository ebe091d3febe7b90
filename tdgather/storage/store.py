"""`Store`: the place a dataset's files are kept, as bytes. The storage seam.

Everything tdgather reads or writes goes through a `Store`, one directory (or object prefix) at a
time, and a store knows bytes only: list what is there, a file's size, open a file to read byte
ranges of it (`tdgather.format.codec.ByteSource`), put a file atomically (a whole object or
nothing), put a small one only if it is absent or unchanged, remove one by name. What the bytes
mean (a safetensors shard, an index) is the format's (`tdgather.format`). Two implementations:

- `LocalStore`: a directory on a local or mounted filesystem; files are written to a temporary
  name, fsynced and renamed into place (`tdgather.storage.atomic.LocalFS`), and mapped to be read;
- `tdgather.storage.objects.ObjectStore`: an fsspec URL (``s3://``, ``gs://``, ``az://``,
  ``memory://``, ...); an object is put whole or not at all, and read by byte ranges.

A store says what it can do in three flags, which writers and readers choose by:
``atomic_rename`` (a directory can be staged beside the dataset and renamed into place:
`tdgather.storage.local`; else the commit is the index's conditional put: `tdgather.storage.prefix`),
``conditional_put`` (`Store.put_if`'s condition is the store's own, atomic against other processes)
and ``checksum`` (what `Store.put` computes and the index records: ``"crc32"`` or ``"sha256"``).
tests/store_conformance.py holds the behaviour every store must have. Adding a store is one module,
an entry in `tdgather.storage.location.STORES` (its URL scheme) and a class in
tests/test_store_conformance.py; `tdgather.storage.location.store_at(path, storage_options)` picks one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ..errors import DatasetError
from ..format.codec import ByteSource
from .atomic import LocalFS
from .outdir import fsync_dir

try:  # zlib's CRC-32, the same values, about 5x faster (zlib-ng folds with carry-less multiplies)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # installed without its dependencies: the standard library's
    from zlib import crc32

__all__ = ["DIGEST_BLOCK", "LocalStore", "MappedFile", "Store", "Written", "crc32_of", "digest", "hashed"]

DIGEST_BLOCK = 8 << 20  # `digest` reads a file this many bytes at a time


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
    atomic_rename: bool  # a directory can be staged beside the dataset and renamed into place
    conditional_put: bool  # put_if's condition is the store's own, atomic against other processes
    checksum: str  # what put computes and the index records: "crc32" or "sha256"

    def path(self, name: str) -> str:
        """One file of the store, as messages name it."""

    def list(self) -> dict[str, int]:
        """Every file in the store, and below it (as ``sub/name``), with its size in bytes."""

    def size(self, name: str) -> int | None:
        """A file's size, or None where it is not there (or not a regular file)."""

    def read(self, name: str) -> bytes:
        """A whole file (an index, a record); `DatasetError` where it is not there."""

    def open(self, name: str) -> ByteSource:
        """A file to read byte ranges of; `DatasetError` where it is not there.

        Its ``size`` is the file's when opened. A local file's bytes stay those (it is mapped); an
        object's are read at each read, so one replaced meanwhile reads new bytes or fails: readers
        check what they read against what the header and the index said.
        """

    def put(self, name: str, chunks: Iterable, then: Callable[[Callable[[], None]], None] | None = None) -> Written:
        """Write a file from its chunks (bytes-like), atomically: the whole file appears, or nothing.

        With ``then``, the last step (making it durable) may be handed to it to run later. An error
        of ``chunks`` is raised as it is; the file is then as it was (or not there).
        """

    def remove(self, name: str) -> None:
        """Remove one file by name (absent: nothing happens)."""

    def version(self, name: str) -> str | None:
        """A token that changes whenever the file is written again (an ETag, a stat); None where it is absent."""

    def abort_uploads(self, runs: Iterable[str]) -> list[str]:
        """Drop what uploads of ``runs`` (run ids) left unfinished, after a commit; the names. Most stores: ``[]``.

        A store whose ``put`` can leave stored but invisible bytes behind when its process is killed
        (an S3 multipart upload) removes them here, best effort: it logs its own errors, never raises.
        """

    def put_if(self, name: str, data: bytes, expected: str | None) -> bool:
        """Write a small file whole only if its `version` is still ``expected`` (None: only if absent).

        The one commit step goes through this (`tdgather.storage.prefix`). Where the store can
        (``conditional_put``: S3's ``If-Match`` / ``If-None-Match``, a lock on a local directory)
        the condition is the store's own; elsewhere it is checked just before the write. False
        when the file changed (another run committed): nothing was written.
        """


def hashed(chunks: Iterable, digest: Any, count: list[int]) -> Iterator:
    """``chunks`` as they are, each added to ``digest`` (a hashlib object, or None) and its length to ``count[0]``."""
    for chunk in chunks:
        if digest is not None:
            digest.update(chunk)
        count[0] += memoryview(chunk).nbytes
        yield chunk


def crc32_of(chunks: Iterable, crc: list[int]) -> Iterator:
    """``chunks`` as they are, each added to the CRC-32 in ``crc[0]`` (zlib's: start it at 0)."""
    for chunk in chunks:
        crc[0] = crc32(chunk, crc[0])
        yield chunk


def digest(store: Store, name: str, sha256: bool = True) -> Written:
    """A file's size, sha256 (unless not ``sha256``) and CRC-32, read whole a block at a time."""
    source = store.open(name)
    h, crc = (hashlib.sha256() if sha256 else None), 0
    for at in range(0, source.size, DIGEST_BLOCK):
        block = source.read(at, min(at + DIGEST_BLOCK, source.size))
        if h is not None:
            h.update(block)
        crc = crc32(block, crc)
    return Written(source.size, None if h is None else h.hexdigest(), crc)


class MappedFile:
    """A local file as a `tdgather.format.codec.ByteSource`: mapped, so reads are views and cost no copy.

    The mapping keeps the bytes the file had when it was opened after its name is replaced or
    removed. It is private (copy on write): a tensor made over it can be written to without
    touching the file.
    """

    mapped = True

    def __init__(self, path: str, where: str) -> None:
        self.where = where
        with open(path, "rb") as fh:
            self.size = os.fstat(fh.fileno()).st_size
            self._map: Any = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if self.size else b""
        self._view = memoryview(self._map)

    def read(self, start: int, end: int) -> memoryview:
        """A view of bytes ``start:end``."""
        return self._view[start:end]


class LocalStore:
    """A directory on a local (or mounted) filesystem: files renamed into place, and mapped to be read.

    Only files directly in the directory are opened; a link is followed only to a file in it.
    ``put`` computes each file's CRC-32 as it writes it (the index lists it: ``verify()`` checks
    every byte against it). ``checksums``: its sha256 too. Off by default: hashing costs more than
    writing to the page cache (docs/object-storage.md has the figures); a CRC-32 costs a fraction.
    """

    atomic_rename = True
    conditional_put = True  # under flock (a filesystem without locks: checked, unlocked)
    checksum = "crc32"

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

    def open(self, name: str) -> MappedFile:
        """The file, mapped (`MappedFile`); a link that leads out of the directory is refused."""
        real = self._inside(name)
        try:
            return MappedFile(real, self.path(name))
        except (OSError, ValueError) as e:
            raise DatasetError(self.path(name), "file", f"expected a readable file, got {e}") from e

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

    def abort_uploads(self, runs: Iterable[str]) -> list[str]:
        """Nothing: a killed write leaves a temporary file, which the next run in the directory removes."""
        return []

    def put_if(self, name: str, data: bytes, expected: str | None) -> bool:
        """Under an exclusive lock on the directory: check the version, then put (temporary name, rename).

        Only if absent (``expected`` None): written under a temporary name, then hard-linked to
        ``name``, which fails where ``name`` exists: atomic without the lock too (a filesystem whose
        locks do not reach other hosts), so a file is never put over another's.
        """
        if expected is None:
            return self._put_new(name, data)
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

    def _put_new(self, name: str, data: bytes) -> bool:
        """``data`` as ``name`` only if absent: a temporary file, fsynced, hard-linked to ``name`` (fails if there)."""
        tmp = self.root / f".{name}.tmp-{os.getpid()}{secrets.randbelow(10**9):09d}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                self.fs.write_all(fd, [data])
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, self.root / name)
            except FileExistsError:
                return False
            fsync_dir(self.root)
            return True
        finally:
            tmp.unlink(missing_ok=True)
