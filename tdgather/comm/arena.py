"""A chunk's batches copied once, at ``add``, into the shm file the chunk is sent in: `Arena`.

A Collector's sender on rank dst's host claims a ring file of its `tdgather.comm.shm.ShmWriter`
when a chunk begins (a one-shot file while rank dst holds every ring file). `add` copies each batch
of the chunk's layout into it, back to back, where the data message will lay its rows out; the
chunk is then sent in that file: one copy per byte on the sender. A batch is copied there:

- a contiguous CPU batch, into pages not allocated yet, with ``pwrite`` (`ShmWriter.pwrite`): the
  kernel allocates each page as it copies into it, with no page zeroed first and no page fault in
  this process; into pages already there (a ring file on its next lap), through the mapping;
- a CPU batch that is not contiguous, through the mapping, once its pages are allocated
  (`ShmWriter.allocate`);
- a CUDA batch, by the GPU, asynchronously, once the ring file is page-locked whole
  (`ShmWriter.pin`, `tdgather.comm.pinning`); the store waits for those copies before the chunk is
  sent.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .shmfiles import hand_back

__all__ = ["Arena", "Files"]


class Files(Protocol):
    """What an arena needs of its sender's shm files (`tdgather.comm.shm.ShmWriter`); ``kept``: one of them."""

    def claim(self, size: int) -> Any:
        """An shm file of at least ``size`` bytes, or None (no room)."""

    def pin(self, kept: Any, device: torch.device) -> bool:
        """Whether ``kept`` is page-locked for copies from ``device``."""

    def allocate(self, kept: Any, upto: int) -> bool:
        """Allocate ``kept``'s pages up to byte ``upto``; False: no room."""

    def pwrite(self, kept: Any, at: int, data: torch.Tensor) -> bool:
        """Write ``data`` (uint8) into ``kept`` from byte ``at``, past its allocated pages; False: no room."""

    def close_one_shot(self, kept: Any, sent: bool) -> None:
        """A one-shot file done with here: closed, and removed unless ``sent``."""


class Arena:
    """Where a chunk's copied batches go (`tdgather.core.framestore.FrameStore`'s ``arena``): a kept shm file.

    A batch is copied there once, at ``add``, right after the one before, so the chunk's shm file is
    written as the batches come and its data message needs no copy of them: the file holds one
    layout's single tensor leaf, whose rows the message lays out back to back from offset 0
    (`tdgather.comm.wire.shm_offsets`). It takes batches of one layout (``key``) only, while they
    fit in its file; from the first it cannot take, it takes none (later rows would not lie where
    the message puts them). `ShmWriter.write` sends its file only if every batch lies at its
    offset, else copies the chunk into another one (or it goes over gloo, from the batches where
    they lie); the sender then hands the arena's file back to the ring once the sends are done
    (`release`). The file is one of the ring, or a one-shot file when every ring file is held.
    """

    def __init__(self, writer: Files, size: int) -> None:
        self.writer, self.size = writer, size
        self.kept: Any = None  # the shm file claimed (`tdgather.comm.shm.ShmWriter.claim`)
        self.key: Any = None
        self.at = 0
        self.closed = False
        self.sent = False  # its file was the chunk's: rank dst hands it back
        self._base: torch.Tensor | None = None

    def take(self, key: Any, nbytes: int, device: torch.device | None = None) -> torch.Tensor | None:
        """``nbytes`` of the file for a batch of ``key``'s layout (uint8), or None: copy it elsewhere.

        ``device``: the CUDA device the batch is copied from, so the file must be page-locked (`ShmWriter.pin`).
        """
        if not self._next(key, nbytes, device) or not self.writer.allocate(self.kept, self.at + nbytes):
            self.closed = True
            return None
        return self._advance(nbytes)

    def put(self, key: Any, t: torch.Tensor) -> torch.Tensor | None:
        """A CPU batch of ``key``'s layout copied into the file: its copy there (``t``'s dtype and shape), or None.

        Where the file's pages are not allocated yet, a contiguous batch is written with ``pwrite``
        (`ShmWriter.pwrite`): the kernel allocates each page as it copies into it. Into pages already
        there (a ring file on its next lap), it is copied through the mapping.
        """
        flat = _flat_bytes(t)
        if flat is None:  # not contiguous: copied through the mapping, its strides resolved
            out = self.take(key, t.nbytes)
            return None if out is None else out.view(t.dtype).view(t.shape).copy_(t)
        nbytes = t.nbytes
        if not self._next(key, nbytes, None):
            return None
        at, kept = self.at, self.kept
        split = min(max(kept.allocated, at), at + nbytes)  # bytes before it have their pages
        if split < at + nbytes and not self.writer.pwrite(kept, split, flat[split - at :]):
            self.closed = True
            return None
        out = self._advance(nbytes)
        out[: split - at].copy_(flat[: split - at])
        return out.view(t.dtype).view(t.shape)

    def _next(self, key: Any, nbytes: int, device: torch.device | None) -> bool:
        """Whether a batch of ``key``'s layout, ``nbytes``, goes next into the file (claimed at first); else close."""
        if self.closed:
            return False
        if self.kept is None:
            self.kept = self.writer.claim(self.size)
            if self.kept is None:
                self.closed = True
                return False
            self.key, self._base = key, torch.frombuffer(self.kept.mm, dtype=torch.uint8)
        if (
            key is not self.key
            or self.at + nbytes > self.kept.size
            or (device is not None and not self.writer.pin(self.kept, device))
        ):
            self.closed = True
            return False
        return True

    def _advance(self, nbytes: int) -> torch.Tensor:
        out, self.at = self._base[self.at : self.at + nbytes], self.at + nbytes
        return out

    def in_place(self, pieces: list[list[torch.Tensor]], offsets: list[int]) -> bool:
        """Whether every tensor of ``pieces`` that lies in the file lies at its offset there."""
        if self._base is None:
            return False
        base, end = self._base.data_ptr(), self._base.data_ptr() + self.kept.size
        for at, piece in zip(offsets, pieces, strict=True):
            for t in piece:
                if base <= t.data_ptr() < end and t.data_ptr() != base + at:
                    return False
                at += t.numel()
        return True

    def release(self) -> None:
        """Once the chunk's sends are done: a ring file the chunk was not sent in goes back to the ring.

        A one-shot file is closed here (rank dst maps it by name), and removed if the chunk was not sent in it.
        """
        kept, self.closed = self.kept, True
        if kept is not None and not kept.ring:
            self.writer.close_one_shot(kept, self.sent)
        elif kept is not None and not self.sent:
            hand_back(kept.path)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous CPU tensor's bytes as one uint8 view, or None (not contiguous, or no such view)."""
    if not t.is_contiguous():
        return None
    try:
        return t.reshape(-1).view(torch.uint8)
    except RuntimeError:
        return None
