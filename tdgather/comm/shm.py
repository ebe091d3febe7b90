"""Same-host peers: a chunk's bytes handed over in a shared memory file, only its header over gloo.

On one host, gloo's TCP loopback is far below what memory moves. A sender that shares rank dst's
host (rank dst names its host in the ready answer: `tdgather.comm.shmfiles.host_token`) writes a
packed chunk's pieces into a new file in ``/dev/shm`` (`ShmWriter`) and sends the data message with
``"shm": {"name", "size"}`` instead of piece messages. Each tensor leaf's bytes start at a multiple
of `ALIGN`, in the order the pieces would have come (`tdgather.comm.wire.shm_offsets`).

Rank dst treats the shm file as hostile input (`open_shm`): the name must be one tdgather makes
(no path), the file a regular file of its own user in the shm directory, not a link, of exactly
the announced size; it is mapped and unlinked at once, so the memory is freed when the last view of
it goes, and no shm file outlives rank dst's use of it. Its bytes are only frame values: every row
count and length comes from the data message, checked as before. The file's contents and length
after that are protected by its mode (0600): processes of the job's own user are trusted, as they
can already attach to the job's processes. Every rank must use the same directory: its path is part
of the host token, so a rank with another one uses gloo.

A ring: a sender keeps its first `RING` shm files (``"keep": true`` in the data message) and writes
its later chunks into them again, so that most chunks are copied into memory already touched
rather than into new pages (on these machines a new page costs more than the copy). Rank dst maps
a kept shm file without unlinking it, and once the last view of that mapping is gone (the spill
that held its rows is written) hands it back by renaming it ``<name>.free``; a sender takes a
shm file back by renaming it to its name again (`ShmWriter.write`). A sender never waits for
one: with none handed back, the chunk goes into a new shm file, unlinked by rank dst as it maps it.

A Collector's sender copies each batch at ``add`` straight into a ring file, where its chunk's
data message will lay the rows out (`tdgather.comm.arena.Arena`): the chunk is then sent in that
file with nothing more copied.

Lifetime: an shm file is written whole before its header is sent, so a sender killed mid-write
loses only that chunk. A sender removes at close whatever of its own rank dst did not take, and
its ring. A sender lost mid-run (killed, hung) cannot: rank dst removes, when the run ends, every
shm file of the writers that peer named in its data messages (`tdgather.comm.shmfiles.PeerShm`: its ring, and a
chunk it was killed writing). What a sender leaves before its first data message reached rank dst
is removed by the next tdgather on that host whose process (in the writer's PID namespace) finds
the writer's pid dead (`tdgather.comm.shmfiles.sweep`). Where the directory is missing, not writable or would keep less
than ``TDGATHER_SHM_SPARE`` bytes free (default 64 MiB), the chunk goes over gloo (one log line).
``TDGATHER_SHM=0`` turns the path off (the benchmarks' ``--gloo-only``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.checks import ProtocolCheck
from .arena import Arena
from .pinning import Register, Unpin, register
from .shmfiles import FREE, SHM_NAME, hand_back, pid_namespace, shm_dir

__all__ = ["RING", "ShmWriter", "open_shm", "ring_size"]

log = logging.getLogger("tdgather")

RING = 3  # shm files a sender keeps and writes again (``TDGATHER_SHM_RING``)
ALLOCATE_STEP = 4 << 20  # an arena's pages are allocated this many bytes at a time


_said: set[str] = set()  # the values of TDGATHER_SHM_RING logged by this process (one line each)


@dataclass
class _Kept:
    """An shm file of the ring: its file (open), this sender's mapping of it, its size, and its bytes allocated.

    The bytes from 0 to ``allocated`` have their pages (`ShmWriter.allocate`); those after are a hole
    of the file, never written before they are allocated. Not ``ring``: an arena's file made while
    every ring file was held, sent once (rank dst unlinks it) or removed.
    """

    path: Path
    fd: int
    mm: mmap.mmap
    size: int
    allocated: int
    ring: bool = True
    unpin: Unpin | None = None  # page-locked for device copies (`ShmWriter.pin`): what undoes it


def ring_size() -> int:
    """``TDGATHER_SHM_RING``, or `RING`: one that is not a count of shm files is logged once, and `RING` used."""
    raw = os.environ.get("TDGATHER_SHM_RING", str(RING))
    if raw.isdigit():
        return int(raw)
    if f"ring {raw}" not in _said:
        _said.add(f"ring {raw}")
        log.warning("tdgather: TDGATHER_SHM_RING=%r is not a count of shm files (an integer >= 0); using %d", raw, RING)
    return RING


class ShmWriter:
    """One sender's shm files: each packed chunk written into one (or None: send it over gloo)."""

    def __init__(self, ring: int | None = None, pin: Register = register) -> None:
        """``pin``: page-locks a ring file's mapping for device copies (`tdgather.comm.pinning.register`)."""
        self.dir = shm_dir()
        self.token = secrets.token_hex(4)
        self.number = 0
        self.made: list[Path] = []
        self.kept: list[_Kept] = []
        self.one_shot: list[_Kept] = []  # arenas' one-shot files still open here (`Arena.release` closes them)
        self.ring = ring_size() if ring is None else ring
        self.warned = False
        self._pin: Register | None = pin  # None once it failed: not tried again
        self._lock = threading.RLock()  # the loop's thread claims arenas, the send thread writes chunks

    def arena(self, size: int) -> Arena:
        """An `Arena` of ``size`` bytes for the next chunk's batches (it claims a kept shm file when first used)."""
        return Arena(self, size)

    def claim(self, size: int) -> _Kept | None:
        """An shm file of at least ``size`` bytes for an arena; None where the directory has no room.

        One of the ring (handed back, or new), else a new one-shot file: while every ring file is
        held, the batches still go into memory rank dst maps, copied once.

        A new file's pages are allocated as the batches fill it (`tdgather.comm.arena.Arena`), not at
        once: a chunk fills about half its arena, and a new page costs more than the copy into it.
        """
        if self.dir is None or not size:
            return None
        with self._lock:
            kept = self._handed_back(size, grow=False)
            if kept is None:
                kept = self._new_kept(size, allocate=False, ring=len(self.kept) < self.ring)
        return kept

    def pin(self, kept: _Kept, device: torch.device) -> bool:
        """Whether ``kept`` is page-locked for copies from ``device``: a ring file, allocated and registered once.

        A one-shot file is not (registering costs more than one chunk's copy gains); once registering
        failed, no file is.
        """
        if kept.unpin is not None:
            return True
        if self._pin is None or not kept.ring or not self.allocate(kept, kept.size):
            return False
        kept.unpin = self._pin(kept.mm, device)
        if kept.unpin is None:
            self._pin = None
        return kept.unpin is not None

    def close_one_shot(self, kept: _Kept, sent: bool) -> None:
        """An arena's one-shot file is done with here: closed (rank dst maps it by name); removed unless ``sent``."""
        with self._lock:
            if kept not in self.one_shot:
                return
            self.one_shot.remove(kept)
        with contextlib.suppress(OSError):
            os.close(kept.fd)
        if not sent:
            self.remove(kept.path)

    def allocate(self, kept: _Kept, upto: int) -> bool:
        """Allocate ``kept``'s pages up to byte ``upto``; False if the directory has no room for them."""
        if kept.allocated >= upto:
            return True
        upto = min(kept.size, -(-upto // ALLOCATE_STEP) * ALLOCATE_STEP)  # not a system call per small batch
        try:
            self._room(upto - kept.allocated)
            os.posix_fallocate(kept.fd, kept.allocated, upto - kept.allocated)  # ENOSPC here, never a SIGBUS
        except OSError:
            return False
        kept.allocated = upto
        return True

    def pwrite(self, kept: _Kept, at: int, data: torch.Tensor) -> bool:
        """Write ``data`` (uint8, contiguous) into ``kept`` from byte ``at``, where no page is allocated yet.

        The kernel allocates each page as it copies into it: no page zeroed first (as `allocate`
        does) and no page fault in this process's mapping. On these machines that is about a third
        faster than allocating, then copying through the mapping; into pages already there, the
        mapping is faster. False if the directory has no room (ENOSPC here, never a SIGBUS).
        """
        view = memoryview(data.numpy())
        try:
            self._room(len(view))
            done = 0
            while done < len(view):
                done += os.pwrite(kept.fd, view[done:], at + done)
        except OSError:
            return False
        if at <= kept.allocated:  # no hole before ``at``: every page up to the end is there now
            kept.allocated = max(kept.allocated, at + len(view))
        return True

    def write(
        self, pieces: list[list[torch.Tensor]], offsets: list[int], size: int, arena: Arena | None = None
    ) -> tuple[str, bool] | None:
        """Write the pieces (uint8 tensors each, in order) at ``offsets``.

        With ``arena`` (the chunk's batches were copied into its shm file), that file is the one
        sent when every batch there lies at its offset: only the other pieces are written. Else the
        chunk is copied into another shm file (never within the arena's own), or goes over gloo
        (None): the caller calls ``arena.release()`` once those sends are done, not before.

        Returns the shm file's name and whether it is kept (rank dst hands it back), or None.
        """
        if self.dir is None:
            return None
        kept = arena.kept if arena is not None else None
        if kept is not None and size <= kept.size and arena.in_place(pieces, offsets) and self.allocate(kept, size):
            _fill(kept.mm, pieces, offsets)  # the batches in place already are not copied
            if not kept.ring:  # rank dst maps exactly the announced size, and unlinks it
                os.ftruncate(kept.fd, size)
            arena.sent = True
            return kept.path.name, kept.ring
        return self._write(pieces, offsets, size)

    def _write(self, pieces: list[list[torch.Tensor]], offsets: list[int], size: int) -> tuple[str, bool] | None:
        """`write` into a kept shm file handed back, a new kept one, or a new one rank dst unlinks."""
        with self._lock:
            kept = self._handed_back(size) if size else None
            if kept is None and size and len(self.kept) < self.ring:
                kept = self._new_kept(size)
                if kept is None:
                    return None
        if kept is not None:
            _fill(kept.mm, pieces, offsets)
            return kept.path.name, True
        made = self._create(size)
        if made is None:
            return None
        path, fd = made
        try:
            if size:
                with mmap.mmap(fd, size, access=mmap.ACCESS_WRITE) as mm:
                    _fill(mm, pieces, offsets)
        finally:
            os.close(fd)
        self._made(path)
        return path.name, False

    def _made(self, path: Path) -> None:
        """A one-shot shm file: removed at `cleanup` unless rank dst took it."""
        with self._lock:
            if len(self.made) >= 64:  # those rank dst took are gone: keep only what may still need removing
                self.made = [p for p in self.made if p.exists()]
            self.made.append(path)

    def _new_kept(self, size: int, allocate: bool = True, ring: bool = True) -> _Kept | None:
        """A new shm file of the ring, its pages allocated or (not ``allocate``) a hole; None: no room, logged.

        Not ``ring``: an arena's one-shot file, removed at `cleanup` unless rank dst took it.
        """
        made = self._create(size, allocate)
        if made is None:
            return None
        path, fd = made
        kept = _Kept(path, fd, mmap.mmap(fd, size, access=mmap.ACCESS_WRITE), size, size if allocate else 0, ring)
        if ring:
            self.kept.append(kept)
        else:
            self._made(path)
            self.one_shot.append(kept)
        return kept

    def _create(self, size: int, allocate: bool = True) -> tuple[Path, int] | None:
        """A new shm file of ``size`` bytes, its pages allocated unless not ``allocate`` (no room: None, logged)."""
        assert self.dir is not None
        with self._lock:  # a number of its own, whichever thread makes it
            path = self.dir / f"tdgather-{os.getpid()}-{pid_namespace()}-{self.token}-{self.number}"
            self.number += 1
        try:
            self._room(size if allocate else 0)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            self._fall_back(e)
            return None
        try:
            os.ftruncate(fd, size)
            if size and allocate:
                os.posix_fallocate(fd, 0, size)  # its pages now: a full directory is ENOSPC here, never a SIGBUS
        except OSError as e:  # the directory filled up meanwhile
            os.close(fd)
            self.remove(path)
            self._fall_back(e)
            return None
        return path, fd

    def _room(self, size: int) -> None:
        st = os.statvfs(self.dir)
        spare = int(os.environ.get("TDGATHER_SHM_SPARE", 64 << 20))
        if st.f_bavail * st.f_frsize < size + spare:
            raise OSError(
                f"{self.dir} has {st.f_bavail * st.f_frsize} bytes free, a chunk of {size} would leave less than "
                f"TDGATHER_SHM_SPARE={spare}"
            )

    def _handed_back(self, size: int, grow: bool = True) -> _Kept | None:
        """A kept shm file rank dst has let go of, taken back; or None.

        With ``grow`` (a chunk is written into it whole), grown to ``size`` if need be and its pages
        allocated up to there; else (an arena's) one of at least ``size`` bytes, as it is.
        """
        for kept in self.kept:
            if kept.size < size and not grow:
                continue
            try:
                os.rename(kept.path.with_name(kept.path.name + FREE), kept.path)
            except OSError:  # not handed back (yet)
                continue
            if not grow:
                return kept
            if kept.size < size:
                with contextlib.suppress(OSError):
                    os.ftruncate(kept.fd, size)
                    _unpin(kept)
                    # the old mapping is not closed: views of it (a sent chunk's) may be alive; it goes with the last
                    kept.mm, kept.size = mmap.mmap(kept.fd, size, access=mmap.ACCESS_WRITE), size
            if kept.size < size or not self.allocate(kept, size):  # no room to grow it: it waits for a smaller chunk
                os.rename(kept.path, kept.path.with_name(kept.path.name + FREE))
                return None
            return kept
        return None

    def _fall_back(self, e: BaseException) -> None:
        if not self.warned:
            log.info("tdgather: shared memory unavailable (%s); this rank's chunks go over gloo", e)
            self.warned = True

    def remove(self, path: Path) -> None:
        """Remove one of its shm files, if it is there."""
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def cleanup(self) -> None:
        """Remove every shm file it made that rank dst did not take (it unlinks those it maps), and the ring."""
        for kept in list(self.one_shot):  # an arena whose chunk was never sent (the run failed): its memory too
            self.close_one_shot(kept, sent=False)
        for path in self.made:
            self.remove(path)
        self.made.clear()
        for kept in self.kept:
            _unpin(kept)
            with contextlib.suppress(BufferError):
                kept.mm.close()
            os.close(kept.fd)
            self.remove(kept.path)
            self.remove(kept.path.with_name(kept.path.name + FREE))
        self.kept.clear()


def _unpin(kept: _Kept) -> None:
    if kept.unpin is not None:
        kept.unpin, unpin = None, kept.unpin
        unpin()


def _fill(mm: mmap.mmap, pieces: list[list[torch.Tensor]], offsets: list[int]) -> None:
    out = torch.frombuffer(mm, dtype=torch.uint8)
    base = out.data_ptr()
    for at, piece in zip(offsets, pieces, strict=True):
        for t in piece:
            if t.data_ptr() != base + at:  # a batch an arena holds lies there already
                out[at : at + t.numel()].copy_(t)
            at += t.numel()


def open_shm(name: Any, size: int, src: int, keep: bool = False) -> torch.Tensor:
    """Map shm file ``name`` of peer ``src`` (uint8 ``[size]``), checked as hostile input, and unlink it.

    A ``keep`` shm file (of the sender's ring) is left in place, at least ``size`` bytes, and handed
    back once the last view of the mapping is gone.
    """
    if not isinstance(name, str) or not SHM_NAME.fullmatch(name):
        raise ProtocolCheck(src).fail(
            "header.shm.name", "an shm file name tdgather makes ('tdgather-<pid>-<namespace>-<token>-<n>')", name
        )
    where = shm_dir()
    if where is None:
        raise ProtocolCheck(src).fail("header.shm", "no shm file: shared memory is off on rank dst", name)
    path = where / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        gone = " (removed before rank dst mapped it: by another process sweeping the directory?)"
        expected = f"an shm file in {where}" + (gone if isinstance(e, FileNotFoundError) else "")
        raise ProtocolCheck(src).fail("header.shm.name", expected, f"{name} ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        fits = st.st_size >= size if keep else st.st_size == size
        if not (st.st_mode & 0o170000 == 0o100000 and st.st_uid == os.getuid() and fits):
            expected = f"a regular file of user {os.getuid()} of {'at least ' if keep else ''}{size} bytes"
            raise ProtocolCheck(src).fail(
                "header.shm", expected, f"mode {oct(st.st_mode)}, user {st.st_uid}, {st.st_size} bytes"
            )
        # read-only and shared: nothing is copied, and its pages are mapped at once (not one fault per page)
        populate = getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)
        if not keep:
            with contextlib.suppress(OSError):  # (a directory stays)
                path.unlink()  # mapped: the memory lives as long as the views of it
    if mm is None:
        if keep:
            hand_back(path)
        return torch.empty(0, dtype=torch.uint8)
    if keep:
        weakref.finalize(mm, hand_back, path)
    with warnings.catch_warnings():  # a read-only buffer: its views are read, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)
