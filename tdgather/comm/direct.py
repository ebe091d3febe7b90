"""Same-host senders of `gather` write their rows straight into rank dst's result: one copy a byte.

On one host, the fastest way for a sender's frames to reach rank dst's result is for the sender to
copy them there itself, while rank dst copies its own: each byte is copied once, by the rank that
holds it, all at once. Through gloo (or a segment rank dst copies from) each byte is copied two or
three times, the last ones by rank dst alone.

1. Rank dst opens a call with a ready answer (`ResultMemory.ready`): its host token, and a
   ``memfd`` (an anonymous shared memory file: it has no path, is not limited by ``/dev/shm``'s
   size, and goes with the last process that holds it) named by its pid, descriptor and a random name.
2. A sender on that host (`Target.open`) opens it through ``/proc/<pid>/fd/<fd>`` and checks that
   it is that memfd of its own user; where it can (and it has only fixed-size leaves and at least
   `DIRECT_MIN` bytes), its data message says ``"direct": true`` and carries no pieces.
3. With every frame index in hand, rank dst sizes the memfd to its whole result, seals its size
   (``F_SEAL_SHRINK | F_SEAL_GROW``: no process can cut it under a mapping), places every
   buffer in it (`ResultMemory.arena`), writes each direct sender's row places into it and answers
   each one where its rows go (`ResultMemory.place`); or answers ``{"place": null}``, and the sender
   sends its pieces as any other.
4. The sender checks that answer as hostile input (every offset, size and row place within the
   memfd and its own rows) and scatters its rows into place (`Target.write`), then sends ``done``.
   Rank dst counts that sender's frames as landed only on its ``done``: a sender killed mid-write
   loses only its own frames, which the result leaves out, as it does a gloo sender's.

``TDGATHER_SHM=0`` turns this off with the rest of the same-host path (`tdgather.comm.shm`).
Processes of the job's own user are trusted with the memfd, as with shm files: they can already
attach to the job's processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import re
import secrets
from typing import Any

import torch

from ..core.checks import ProtocolCheck
from ..core.part import Part
from ..core.scatter import scatter_chunks
from .shm import host_token
from .wire import ALIGN  # every buffer starts at a multiple of this

__all__ = ["DIRECT_MIN", "DIRECT_ROW", "ResultMemory", "Target", "fixed_size", "result_nbytes", "wants_direct"]

log = logging.getLogger("tdgather")

DIRECT_MIN = 1 << 20  # a sender with fewer tensor bytes sends them over gloo: a round trip costs more
# ... and one with smaller frames: it would write them only once rank dst has placed every row, while
# pieces over gloo come during the placement (`benchmarks.suite`, tiny: 64-byte frames, 4 ranks on 2
# cores: 0.077-0.080 s in place against 0.057-0.064 s over gloo)
DIRECT_ROW = 1024
MEMFD_NAME = re.compile(r"tdgather-result-[0-9a-f]{16}")
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
    """Rank dst's side: the memfd its result is placed in, when a same-host sender writes there."""

    def __init__(self) -> None:
        self.token = host_token()
        self.fd: int | None = None
        self.name = ""
        self.data: torch.Tensor | None = None
        self.at = 0
        if self.token is not None and hasattr(os, "memfd_create"):
            self.name = f"tdgather-result-{secrets.token_hex(8)}"
            try:
                self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            except OSError as e:
                _say_once("no memfd for same-host senders", e)

    def ready(self) -> dict[str, Any]:
        """The ready answer's fields: this host, and the memfd a same-host sender may open."""
        if self.fd is None:
            return {}
        return {"host": self.token, "memfd": {"pid": os.getpid(), "fd": self.fd, "name": self.name}}

    def arena(self, nbytes: int) -> bool:
        """Size and seal the memfd for ``nbytes`` of buffers and map it; False if it cannot be."""
        if self.fd is None:
            return False
        try:
            # not allocated here: each process touches the pages it writes, all at once. A memfd lives
            # on the kernel's own mount, which has no size limit (unlike /dev/shm): no write into it
            # can fail for room (a SIGBUS); running out of memory is what it is for `torch.empty`
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)  # and no process can cut it under a mapping
            # mapped by torch, which keeps no descriptor open (a Python mmap keeps one as long as the
            # result lives: results kept would use up the process's descriptors)
            path = f"/proc/self/fd/{self.fd}"
            data = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8) if nbytes else None
        except (OSError, RuntimeError) as e:
            _say_once("same-host senders cannot write into rank dst's result", e)
            self.close()
            return False
        self.data = data if data is not None else torch.empty(0, dtype=torch.uint8)
        return True

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next buffer of the arena (`tdgather.core.plan.Placement.allocate`'s ``empty``)."""
        assert self.data is not None
        n = math.prod(shape) * dtype.itemsize
        start, self.at = self.at, self.at + -(-n // ALIGN) * ALIGN
        return self.data[start : start + n].view(dtype).view(shape)

    def place(self, buffers: list[list[torch.Tensor]], dests: list[tuple[int, torch.Tensor]]) -> dict[str, Any]:
        """The place answer for a sender's parts: ``dests`` (each part's buffers group, its rows' places).

        The places are written into the arena (taken after every buffer); the answer names, per
        part, where they are and where each leaf's buffer is.
        """
        groups = []
        for k, dest in dests:
            at = self.take((dest.numel(),), torch.int64)
            at.copy_(dest)
            leaves = [[self._offset(b), b.shape[0], math.prod(b.shape[1:]) * b.element_size()] for b in buffers[k]]
            groups.append({"dest": [self._offset(at), dest.numel()], "leaves": leaves})
        return {"size": self.data.numel() if self.data is not None else 0, "groups": groups}

    def _offset(self, t: torch.Tensor) -> int:
        assert self.data is not None
        return t.data_ptr() - self.data.data_ptr() if t.numel() else 0

    def close(self) -> None:
        """Close the descriptor (the mapping, the result, lives on while viewed)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def result_nbytes(shapes: list[tuple[tuple[int, ...], torch.dtype]], dests: list[int]) -> int:
    """The arena for buffers of ``shapes`` and ``dests`` row-place arrays (of that many rows each)."""
    sizes = [math.prod(s) * d.itemsize for s, d in shapes] + [n * 8 for n in dests]
    return sum(-(-n // ALIGN) * ALIGN for n in sizes)


class Target:
    """A sender's side: rank dst's memfd, opened; its rows are written there once rank dst says where."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @staticmethod
    def open(ready: dict, parts: list[Part]) -> Target | None:
        """Rank dst's memfd from its ready answer, when it is on this host and worth it; else None."""
        memfd = ready.get("memfd")
        here = host_token()
        if here is None or ready.get("host") != here or not isinstance(memfd, dict) or not wants_direct(parts):
            return None
        pid, fd, name = memfd.get("pid"), memfd.get("fd"), memfd.get("name")
        if type(pid) is not int or type(fd) is not int or not isinstance(name, str) or not MEMFD_NAME.fullmatch(name):
            return None
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path) != f"/memfd:{name} (deleted)":  # another process of that pid (a container)
                return None
            own = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            _say_once("rank dst's result memory cannot be opened from here", e)
            return None
        st = os.fstat(own)
        if st.st_uid != os.getuid() or st.st_mode & 0o170000 != 0o100000:
            os.close(own)
            return None
        return Target(own)

    def write(self, place: Any, parts: list[Part], dst: int) -> None:
        """Check rank dst's place answer (hostile input) and scatter each part's rows into place."""
        c = ProtocolCheck(dst)
        c.obj(place, "header.place", {"size", "groups"})
        size = c.int(place["size"], "header.place.size")
        st = os.fstat(self.fd)
        seals = fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)
        if st.st_size != size or seals & _SEALS != _SEALS:
            raise c.fail(
                "header.place.size",
                f"a memfd of {size} bytes sealed against resizing",
                f"{st.st_size} bytes, seals {seals:#x}",
            )
        groups = c.list(place["groups"], "header.place.groups", len(parts))
        if not size:
            return
        mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        try:
            _write(c, groups, parts, torch.frombuffer(mm, dtype=torch.uint8))
        finally:
            with contextlib.suppress(BufferError):  # a view kept by a traceback: unmapped when it goes
                mm.close()

    def close(self) -> None:
        """Close the descriptor."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _write(c: ProtocolCheck, groups: list, parts: list[Part], data: torch.Tensor) -> None:
    for i, (g, part) in enumerate(zip(groups, parts, strict=True)):
        buffers, dest = _views(c, f"header.place.groups[{i}]", g, part, data)
        scatter_chunks(buffers, [dest] * len(buffers), part.chunks)


def _views(c: ProtocolCheck, f: str, g: Any, part: Part, data: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One part's buffers and row places in the memfd, each bound checked before it is viewed."""
    c.obj(g, f, {"dest", "leaves"})
    size = data.numel()

    def span(x: Any, field: str, row_nbytes: int) -> tuple[int, int]:
        at, rows = (c.int(v, field) for v in c.list(x, field, 2))
        if at % ALIGN or at + rows * row_nbytes > size:
            raise c.fail(field, f"an aligned span inside the {size} bytes", x)
        return at, rows

    at, n = span(g["dest"], f"{f}.dest", 8)
    if n != part.num_frames:
        raise c.fail(f"{f}.dest", f"{part.num_frames} row places (this rank's rows)", n)
    dest = data[at : at + 8 * n].view(torch.int64).clone()  # copied, then checked: rank dst cannot change it after
    buffers = []
    leaves = c.list(g["leaves"], f"{f}.leaves", len(part.layout.leaves))
    for j, (x, leaf) in enumerate(zip(leaves, part.layout.leaves, strict=True)):
        field = f"{f}.leaves[{j}]"
        if c.int(c.list(x, field, 3)[2], field) != leaf.row_nbytes:
            raise c.fail(field, f"rows of {leaf.row_nbytes} bytes ({leaf.dtype} {list(leaf.shape)})", x)
        start, rows = span(x[:2], field, leaf.row_nbytes)
        if n and (int(dest.min()) < 0 or int(dest.max()) >= rows):
            raise c.fail(f"{f}.dest", f"row places in 0..{rows - 1}", [int(dest.min()), int(dest.max())])
        buffers.append(data[start : start + rows * leaf.row_nbytes].view(leaf.dtype).view(rows, *leaf.shape))
    return buffers, dest
