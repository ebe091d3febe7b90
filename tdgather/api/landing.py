"""Where one peer's pieces land on rank dst during `tdgather.gather`: into place, or staged and scattered.

`tdgather.api.gather` reads each peer's pieces on that peer's thread and hands each one a `Landing`;
it answers where the next piece goes (a tensor to receive into) and what to do once it has come.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.protocol import as_bytes
from ..comm.wire import DataHeader
from ..core.ragged import values_of
from ..core.rows import run_start, scatter_rows

__all__ = ["Landing", "mark_landed"]


class Landing:
    """Where one peer's pieces land: straight into place, or into two staging buffers and scattered.

    Pieces that come while rank dst is still placing (every frame index is in) are received into
    new buffers, up to `EARLY_BYTES`, and scattered once the placement is known: the transfer
    overlaps the placement instead of waiting for it.
    """

    EARLY_BYTES = 32 << 20

    def __init__(self, receive: Any, peer: int, header: DataHeader) -> None:  # receive: gather's _Receive
        self.receive, self.peer = receive, peer
        self.parts = receive.parts[peer]
        # the rows of a group count as landed with their last leaf that has pieces
        self.last = [max((j for j, c in enumerate(g.pieces) if c), default=-1) for g in header.groups]
        self.staging = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self.turn = 0
        self.early: list[tuple[int, int, int, int, torch.Tensor]] = []
        self.early_bytes = 0
        self.pieces, self.early_pieces = 0, 0
        self.started = False
        self.ends: dict[int, torch.Tensor] = {}  # group -> where each frame's rows end in its last leaf (ragged)

    def _start(self) -> None:
        """Once placed: groups with no pieces (no tensor bytes) have landed with their data message."""
        self.started = True
        for g, last in enumerate(self.last):
            if last < 0 and not self.receive.discard:
                k, dest, _ = self.receive.dest[(self.peer, id(self.parts[g]))]
                self.receive.landed[k][dest] = True

    def finish(self, last_whole: bool = True) -> None:
        """After the last piece: what came early is scattered, now that the placement is known.

        ``last_whole=False`` (the stream failed): the last piece asked for may not have arrived whole.
        """
        self.receive.placed.wait()
        if not self.started:
            self._start()
        if not last_whole and self.early:
            self.early.pop()
        with self.receive.counting:
            self.receive.pieces[0] += self.pieces
            self.receive.pieces[1] += self.early_pieces
        if not self.receive.discard:
            for g, j, first, rows, into in self.early:
                self._land_rows(g, j, first, rows, into)
        self.early = []

    def _land_rows(self, g: int, j: int, first: int, rows: int, into: torch.Tensor) -> None:
        """Scatter rows received into ``into`` to their places."""
        leaf = self.parts[g].layout.leaves[j]
        k, dest, leaf_dest = self.receive.dest[(self.peer, id(self.parts[g]))]
        d = leaf_dest[j][first : first + rows]
        scatter_rows(values_of(self.receive.buffers[k][j]), d, into.view(leaf.dtype).view(rows, *leaf.shape))
        mark_landed(self.receive.landed[k], self._done(g, j, first, rows, dest))

    def _done(self, g: int, j: int, first: int, rows: int, dest: torch.Tensor) -> torch.Tensor | None:
        """The places of the frames whose last bytes are rows ``first .. first + rows - 1`` of leaf ``j``.

        A frame has landed with its last leaf that has pieces; of a ragged leaf, ``rows`` are
        value rows, and a frame is in once its values have all come (its end is inside the piece).
        """
        if j != self.last[g]:
            return None
        part = self.parts[g]
        if not part.layout.leaves[j].ragged:
            return dest[first : first + rows]
        if g not in self.ends:
            self.ends[g] = torch.cumsum(part.lengths[j], 0)
        ends = self.ends[g]
        lo = int(torch.searchsorted(ends, first, right=True)) if first else 0
        return dest[lo : int(torch.searchsorted(ends, first + rows, right=True))]

    def land(self, g: int, j: int, first: int, rows: int) -> tuple[torch.Tensor, Any]:
        """Where rows ``first ..`` of group ``g``'s leaf ``j`` are received, and what runs once they have come."""
        leaf = self.parts[g].layout.leaves[j]
        nbytes = rows * leaf.row_nbytes
        self.pieces += 1
        if not self.started:
            if not self.receive.placed.is_set() and self.early_bytes + nbytes <= self.EARLY_BYTES:
                into = torch.empty(nbytes, dtype=torch.uint8)
                self.early.append((g, j, first, rows, into))
                self.early_bytes += nbytes
                self.early_pieces += 1
                return into, None
            self.receive.placed.wait()
            self._start()
            if self.early and not self.receive.discard:
                into, then = self._land_now(g, j, first, rows, leaf, nbytes)
                early, self.early = self.early, []

                def both() -> None:
                    for args in early:
                        self._land_rows(*args)
                    if then is not None:
                        then()

                return into, both
            self.early = []
        return self._land_now(g, j, first, rows, leaf, nbytes)

    def _land_now(self, g: int, j: int, first: int, rows: int, leaf: Any, nbytes: int) -> tuple[torch.Tensor, Any]:
        if not self.receive.discard:
            k, dest, leaf_dest = self.receive.dest[(self.peer, id(self.parts[g]))]
            d = leaf_dest[j][first : first + rows]
            buf, landed = values_of(self.receive.buffers[k][j]), self.receive.landed[k]
            mark = self._done(g, j, first, rows, dest)
            start = run_start(d)
            if start is not None:  # one run: straight into place
                return as_bytes(buf[start : start + rows]), lambda: mark_landed(landed, mark)
        i = self.turn
        self.turn ^= 1
        if self.staging[i].numel() < nbytes:
            self.staging[i] = torch.empty(nbytes, dtype=torch.uint8)
        into = self.staging[i][:nbytes]
        if self.receive.discard:
            return into, None

        def scatter() -> None:
            scatter_rows(buf, d, into.view(leaf.dtype).view(rows, *leaf.shape))
            mark_landed(landed, mark)

        return into, scatter


def mark_landed(landed: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Mark frames ``rows`` of a placement as landed (None: none)."""
    if rows is not None:
        landed[rows] = True
