"""Same-host senders of `gather` write their rows straight into rank dst's result: one copy a byte.

On one host, the fastest way for a sender's frames to reach rank dst's result is for the sender to
copy them there itself, while rank dst copies its own: each byte is copied once, by the rank that
holds it, all at once. Through gloo (or a segment rank dst copies from) each byte is copied two or
three times, the last ones by rank dst alone.

1. Rank dst opens a call with a ready answer (`ResultMemory.ready`): its host token, and `REGIONS`
   ``memfd``s (anonymous shared memory files: they have no path, are not limited by ``/dev/shm``'s
   size, and go with the last process that holds them) named by its pid, their descriptors and a
   random name (file ``i`` is ``<name>-<i>``).
2. A sender on that host (`Target.open`) opens each through ``/proc/<pid>/fd/<fd>`` and checks that
   it is that memfd of its own user; where it can (and it has only fixed-size leaves and at least
   `DIRECT_MIN` bytes), its data message says ``"direct": true`` and carries no pieces.
3. With every frame index in hand, rank dst cuts its whole result into one region a memfd, sizes
   and seals each (``F_SEAL_SHRINK | F_SEAL_GROW``: no process can cut one under a mapping), maps
   them back to back as one range (`tdgather.comm.regions`), places every buffer in it
   (`ResultMemory.arena`), writes each direct sender's row places into it and answers each one
   where its rows go and at which of them to start (`ResultMemory.place`); or answers
   ``{"place": null}``, and the sender sends its pieces as any other.
4. The sender checks that answer as hostile input (the files' sizes, every offset, size and row
   place within them and its own rows) and writes its rows into place (`Target.write`): runs of
   large rows with ``pwritev`` into the files (`tdgather.comm.rowwrite`), small ones through a
   mapping; then it sends ``done``. Rank dst writes its own rows the same way meanwhile, from its
   first row while each sender starts further on, so that the writers copy into different files,
   each under its own lock, at once. Rank dst counts a sender's frames as landed only on its
   ``done``: a sender killed mid-write loses only its own frames, which the result leaves out, as
   it does a gloo sender's.

``TDGATHER_SHM=0`` turns this off with the rest of the same-host path (`tdgather.comm.shm`).
Processes of the job's own user are trusted with the memfds, as with shm files: they can already
attach to the job's processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import re
import secrets
from typing import Any

import torch

from ..core.checks import ProtocolCheck
from ..core.part import Part
from ..core.scatter import scatter_chunks
from .regions import REGIONS, map_regions, region_size
from .rowwrite import Files, write_leaves
from .shmfiles import host_token
from .wire import ALIGN  # every buffer starts at a multiple of this

__all__ = ["DIRECT_MIN", "DIRECT_ROW", "ResultMemory", "Target", "fixed_size", "result_nbytes", "wants_direct"]

log = logging.getLogger("tdgather")

DIRECT_MIN = 1 << 20  # a sender with fewer tensor bytes sends them over gloo: a round trip costs more
# ... and one with smaller frames: it would write them only once rank dst has placed every row, while
# pieces over gloo come during the placement (`benchmarks.suite`, tiny: 64-byte frames, 4 ranks on 2
# cores: 0.077-0.080 s in place against 0.057-0.064 s over gloo)
DIRECT_ROW = 1024
MEMFD_NAME = re.compile(r"tdgather-result-[0-9a-f]{16}")  # each file: the name, "-", its number
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4)

_said: set[str] = set()


def _say_once(what: str, e: BaseException) -> None:
    if what not in _said:
        _said.add(what)
        log.info("tdgather: %s (%s); gloo carries the frames", what, e)


def fixed_size(parts: list[Part]) -> bool:
    """Whether every leaf of ``parts`` is fixed-size (no ragged leaf): each frame's row places say where it goes."""
    return not any(leaf.ragged for p in parts for leaf in p.layout.leaves)


def wants_direct(parts: list[Part], least: int = DIRECT_MIN) -> bool:
    """Whether a sender's frames can be written in place.

    Every leaf fixed-size, ``least`` bytes or more in frames of `DIRECT_ROW` bytes or more on average.
    """
    if not fixed_size(parts):
        return False
    nbytes = sum(p.nbytes for p in parts)
    return nbytes >= least and nbytes >= DIRECT_ROW * sum(p.num_frames for p in parts)


class ResultMemory:
    """Rank dst's side: the memfds its result is placed in, when a same-host sender writes there.

    `REGIONS` memfds, each a consecutive region of the result (`tdgather.comm.regions`), so that
    the processes writing into it copy into different files at once.
    """

    def __init__(self) -> None:
        self.token = host_token()
        self.fds: list[int] = []
        self.name = ""
        self.region = 0
        self.data: torch.Tensor | None = None
        self.at = 0
        if self.token is not None and hasattr(os, "memfd_create"):
            self.name = f"tdgather-result-{secrets.token_hex(8)}"
            try:
                for i in range(REGIONS):
                    self.fds.append(os.memfd_create(f"{self.name}-{i}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
            except OSError as e:
                _say_once("no memfd for same-host senders", e)
                self.close()

    def ready(self) -> dict[str, Any]:
        """The ready answer's fields: this host, and the memfds a same-host sender may open."""
        if not self.fds:
            return {}
        return {"host": self.token, "memfd": {"pid": os.getpid(), "fds": self.fds, "name": self.name}}

    def arena(self, nbytes: int) -> bool:
        """Size and seal the memfds for ``nbytes`` of buffers and map them; False if they cannot be."""
        if not self.fds:
            return False
        self.region = region_size(nbytes, len(self.fds))
        try:
            # not allocated here: each process touches the pages it writes, all at once. A memfd lives
            # on the kernel's own mount, which has no size limit (unlike /dev/shm): no write into it
            # can fail for room (a SIGBUS); running out of memory is what it is for `torch.empty`
            for fd in self.fds:
                os.ftruncate(fd, self.region)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # and no process can cut it under a mapping
            # the mapping keeps no descriptor open (results kept would use up the process's descriptors)
            self.data = map_regions(self.fds, self.region)
        except OSError as e:
            _say_once("same-host senders cannot write into rank dst's result", e)
            self.close()
            return False
        return True

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next buffer of the arena (`tdgather.core.plan.Placement.allocate`'s ``empty``)."""
        assert self.data is not None
        n = math.prod(shape) * dtype.itemsize
        start, self.at = self.at, self.at + -(-n // ALIGN) * ALIGN
        return self.data[start : start + n].view(dtype).view(shape)

    def place(
        self, buffers: list[list[torch.Tensor]], dests: list[tuple[int, torch.Tensor]], first: float = 0.0
    ) -> dict[str, Any]:
        """The place answer for a sender's parts: ``dests`` (each part's buffers group, its rows' places).

        The places are written into the arena (taken after every buffer); the answer names, per
        part, where they are and where each leaf's buffer is; and at which fraction of its rows the
        sender starts (``first``: each writer its own, so that they write into different files).
        """
        groups = []
        for k, dest in dests:
            at = self.take((dest.numel(),), torch.int64)
            at.copy_(dest)
            leaves = [[self._offset(b), b.shape[0], _row_nbytes(b)] for b in buffers[k]]
            groups.append({"dest": [self._offset(at), dest.numel()], "leaves": leaves})
        size = self.data.numel() if self.data is not None else 0
        return {"size": size, "region": self.region, "first": first, "groups": groups}

    def land(self, buffers: list[Any], dests: list[Any], chunks: list[list[torch.Tensor]]) -> None:
        """Rank dst's own rows into its result's buffers (`scatter_chunks`' arguments).

        Where the buffers are in the memfds and the rows go in large runs, they are written into
        them (`write_leaves`, from the first row: the senders start elsewhere); the rest is copied.
        """
        rest = list(range(len(buffers)))
        if self.data is not None and chunks:
            starts = [self._offset(b) if type(b) is torch.Tensor and b.numel() else None for b in buffers]
            nbytes = [_row_nbytes(b) if type(b) is torch.Tensor else 0 for b in buffers]
            rest = write_leaves(Files(self.fds, self.region), starts, nbytes, dests, chunks)
        if rest:
            scatter_chunks([buffers[j] for j in rest], [dests[j] for j in rest], [[c[j] for j in rest] for c in chunks])

    def _offset(self, t: torch.Tensor) -> int:
        assert self.data is not None
        return t.data_ptr() - self.data.data_ptr() if t.numel() else 0

    def close(self) -> None:
        """Close the descriptors (the mapping, the result, lives on while viewed)."""
        _close_all(self.fds)
        self.fds = []


def _row_nbytes(b: torch.Tensor) -> int:
    return math.prod(b.shape[1:]) * b.element_size()


def result_nbytes(shapes: list[tuple[tuple[int, ...], torch.dtype]], dests: list[int]) -> int:
    """The arena for buffers of ``shapes`` and ``dests`` row-place arrays (of that many rows each)."""
    sizes = [math.prod(s) * d.itemsize for s, d in shapes] + [n * 8 for n in dests]
    return sum(-(-n // ALIGN) * ALIGN for n in sizes)


class Target:
    """A sender's side: rank dst's memfds, opened; its rows are written there once rank dst says where."""

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds

    @staticmethod
    def open(ready: dict, parts: list[Part]) -> Target | None:
        """Rank dst's memfds from its ready answer, when it is on this host and worth it; else None."""
        memfd = ready.get("memfd")
        here = host_token()
        if here is None or ready.get("host") != here or not isinstance(memfd, dict) or not wants_direct(parts):
            return None
        pid, fds, name = memfd.get("pid"), memfd.get("fds"), memfd.get("name")
        if type(pid) is not int or not isinstance(name, str) or not MEMFD_NAME.fullmatch(name):
            return None
        if not isinstance(fds, list) or not 0 < len(fds) <= REGIONS or any(type(fd) is not int for fd in fds):
            return None
        own: list[int] = []
        for i, fd in enumerate(fds):
            try:
                got = _open_memfd(f"/proc/{pid}/fd/{fd}", f"{name}-{i}")
            except OSError as e:
                _say_once("rank dst's result memory cannot be opened from here", e)
                got = None
            if got is None:  # another process of that pid (a container), or not its memfd
                Target(own).close()
                return None
            own.append(got)
        return Target(own)

    def write(self, place: Any, parts: list[Part], dst: int) -> None:
        """Check rank dst's place answer (hostile input) and write each part's rows into place."""
        c = ProtocolCheck(dst)
        c.obj(place, "header.place", {"size", "region", "first", "groups"})
        size = c.int(place["size"], "header.place.size")
        region = c.int(place["region"], "header.place.region")
        first = place["first"]
        if type(first) not in (int, float) or not 0 <= first < 1:
            raise c.fail("header.place.first", "a fraction of the rows in [0, 1)", first)
        if size != region * len(self.fds):
            raise c.fail("header.place.size", f"{len(self.fds)} regions of {region} bytes", size)
        for fd in self.fds:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if st.st_size != region or seals & _SEALS != _SEALS:
                raise c.fail(
                    "header.place.region",
                    f"memfds of {region} bytes sealed against resizing",
                    f"{st.st_size} bytes, seals {seals:#x}",
                )
        groups = c.list(place["groups"], "header.place.groups", len(parts))
        if not size:
            return
        named = enumerate(zip(groups, parts, strict=True))
        spans = [_spans(c, f"header.place.groups[{i}]", g, part, size) for i, (g, part) in named]  # all, first
        files = Files(self.fds, region)
        dests = [
            _places(c, f"header.place.groups[{i}].dest", files, at, part.num_frames, leaves)
            for i, (part, (at, leaves)) in enumerate(zip(parts, spans, strict=True))
        ]  # every part's, checked before any row is written
        mapped = []  # (part, its row places, leaves, the leaves copied through a mapping)
        for part, (_, leaves), dest in zip(parts, spans, dests, strict=True):
            nbytes = [leaf.row_nbytes for leaf in part.layout.leaves]
            by_map = write_leaves(files, [s for s, _ in leaves], nbytes, [dest] * len(leaves), part.chunks, first)
            if by_map:
                mapped.append((part, dest, leaves, by_map))
        if mapped:
            data = map_regions(self.fds, region)
            for part, dest, leaves, by_map in mapped:
                buffers = [_view(data, leaves[j], part.layout.leaves[j]) for j in by_map]
                scatter_chunks(buffers, [dest] * len(buffers), [[ch[j] for j in by_map] for ch in part.chunks])

    def close(self) -> None:
        """Close the descriptors."""
        _close_all(self.fds)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _open_memfd(path: str, name: str) -> int | None:
    """``path`` (a ``/proc/<pid>/fd/<fd>``) opened, if it is memfd ``name`` of this user; else None."""
    if os.readlink(path) != f"/memfd:{name} (deleted)":
        return None
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o170000 != 0o100000:
        os.close(fd)
        return None
    return fd


def _spans(c: ProtocolCheck, f: str, g: Any, part: Part, size: int) -> tuple[int, list[tuple[int, int]]]:
    """One part's row places and leaf buffers in the memfd: (where the places are, each leaf's (start, rows)).

    Each span is checked to lie inside the ``size`` bytes before anything is read or written there.
    """
    c.obj(g, f, {"dest", "leaves"})

    def span(x: Any, field: str, row_nbytes: int) -> tuple[int, int]:
        at, rows = (c.int(v, field) for v in c.list(x, field, 2))
        if at % ALIGN or at + rows * row_nbytes > size:
            raise c.fail(field, f"an aligned span inside the {size} bytes", x)
        return at, rows

    at, n = span(g["dest"], f"{f}.dest", 8)
    if n != part.num_frames:
        raise c.fail(f"{f}.dest", f"{part.num_frames} row places (this rank's rows)", n)
    spans = []
    leaves = c.list(g["leaves"], f"{f}.leaves", len(part.layout.leaves))
    for j, (x, leaf) in enumerate(zip(leaves, part.layout.leaves, strict=True)):
        field = f"{f}.leaves[{j}]"
        if c.int(c.list(x, field, 3)[2], field) != leaf.row_nbytes:
            raise c.fail(field, f"rows of {leaf.row_nbytes} bytes ({leaf.dtype} {list(leaf.shape)})", x)
        spans.append(span(x[:2], field, leaf.row_nbytes))
    return at, spans


def _places(c: ProtocolCheck, field: str, files: Files, at: int, n: int, leaves: list[tuple[int, int]]) -> torch.Tensor:
    """A part's ``n`` row places, read from the memfds (rank dst cannot change them after) and checked."""
    try:
        raw = files.read(at, n * 8)  # (they may cross into the next file)
    except OSError as e:
        raise c.fail(field, f"{n} row places at byte {at}", str(e)) from e
    dest = torch.frombuffer(raw, dtype=torch.int64) if n else torch.empty(0, dtype=torch.int64)
    rows = min((r for _, r in leaves), default=0)
    if n and (int(dest.min()) < 0 or int(dest.max()) >= rows):
        raise c.fail(field, f"row places in 0..{rows - 1}", [int(dest.min()), int(dest.max())])
    return dest


def _view(data: torch.Tensor, span: tuple[int, int], leaf: Any) -> torch.Tensor:
    """A leaf's buffer in the mapped memfd (its span checked by `_spans`)."""
    start, rows = span
    return data[start : start + rows * leaf.row_nbytes].view(leaf.dtype).view(rows, *leaf.shape)
