"""Where one peer's pieces land on rank dst during `tdgather.gather`: into place, or staged and scattered.

`tdgather.api.receive` reads each peer's pieces on that peer's thread and hands each one a `Landing`,
and, once it has placed every row, the `Placed` of each of that peer's parts (what was placed,
where, what landed); the landing answers where the next piece goes (a tensor to receive into) and
what to do once it has come.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..comm.protocol import as_bytes
from ..comm.wire import DataHeader
from ..core.frames import Leaf
from ..core.part import Part
from ..core.ragged import Ragged, values_of
from ..core.rows import run_start, scatter_rows
from ..core.scatter import ValuePlaces

__all__ = ["Landing", "Placed"]

Then = Callable[[], None] | None  # what runs once a piece has come


@dataclass(frozen=True)
class Placed:
    """Where rank dst placed one part's rows, and what of its placement has landed.

    Attributes:
        part: the part placed (one source's frames of one layout).
        buffers: its placement's result, one buffer per leaf (a ragged leaf's: a `Ragged`).
        landed: one flag per row of its placement's buffers: set once that frame has landed.
        dest: each of the part's frames' row in the buffers (`Placement.dest`).
        leaf_dest: per leaf, each of the part's rows' row in that leaf's buffer (`Placement.leaf_dest`).
    """

    part: Part
    buffers: list[torch.Tensor | Ragged]
    landed: torch.Tensor
    dest: torch.Tensor
    leaf_dest: list[torch.Tensor | ValuePlaces]

    def mark_landed(self, frames: torch.Tensor | None) -> None:
        """Mark ``frames`` (rows of the buffers; None: none) as landed."""
        if frames is not None:
            self.landed[frames] = True


class Landing:
    """Where one peer's pieces land: straight into place, or into two staging buffers and scattered.

    ``placed`` gives, once rank dst has placed every row, where each of the peer's parts went (one
    `Placed` per group of its data message), or None when nothing was placed (placing failed: the
    pieces are read only to keep the stream in step). Pieces that come before it are received into
    new buffers, up to `EARLY_BYTES`, and scattered once it has: the transfer overlaps the placement
    instead of waiting for it.
    """

    EARLY_BYTES = 32 << 20

    def __init__(self, header: DataHeader, placed: Future[list[Placed] | None]) -> None:
        self.layouts = [g.layout for g in header.groups]
        self.placed = placed
        self.where: list[Placed] | None = None  # once placed
        # the rows of a group count as landed with their last leaf that has pieces
        self.last = [max((j for j, c in enumerate(g.pieces) if c), default=-1) for g in header.groups]
        self.staging = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self.turn = 0
        self.early: list[tuple[int, int, int, int, torch.Tensor]] = []
        self.early_bytes = 0
        self.pieces, self.early_pieces = 0, 0  # received, and of them early: `GatherStats`
        self.started = False
        self.ends: dict[int, torch.Tensor] = {}  # group -> where each frame's rows end in its last leaf (ragged)

    def _start(self) -> None:
        """Wait for the placement; groups with no pieces (no tensor bytes) have landed with their data message."""
        self.where = self.placed.result()
        self.started = True
        for g, last in enumerate(self.last):
            if last < 0 and self.where is not None:
                self.where[g].mark_landed(self.where[g].dest)

    def finish(self, last_whole: bool = True) -> None:
        """After the last piece: what came early is scattered, now that the placement is known.

        ``last_whole=False`` (the stream failed): the last piece asked for may not have arrived whole.
        """
        if not self.started:
            self._start()
        if not last_whole and self.early:
            self.early.pop()
        if self.where is not None:
            for g, j, first, rows, into in self.early:
                self._land_rows(g, j, first, rows, into)
        self.early = []

    def _land_rows(self, g: int, j: int, first: int, rows: int, into: torch.Tensor) -> None:
        """Scatter rows received into ``into`` to their places."""
        assert self.where is not None
        placed, leaf = self.where[g], self.layouts[g].leaves[j]
        d = placed.leaf_dest[j][first : first + rows]
        scatter_rows(values_of(placed.buffers[j]), d, into.view(leaf.dtype).view(rows, *leaf.shape))
        placed.mark_landed(self._done(g, j, first, rows, placed))

    def _done(self, g: int, j: int, first: int, rows: int, placed: Placed) -> torch.Tensor | None:
        """The places of the frames whose last bytes are rows ``first .. first + rows - 1`` of leaf ``j``.

        A frame has landed with its last leaf that has pieces; of a ragged leaf, ``rows`` are
        value rows, and a frame is in once its values have all come (its end is inside the piece).
        """
        if j != self.last[g]:
            return None
        if not self.layouts[g].leaves[j].ragged:
            return placed.dest[first : first + rows]
        if g not in self.ends:
            self.ends[g] = torch.cumsum(placed.part.lengths[j], 0)
        ends = self.ends[g]
        lo = int(torch.searchsorted(ends, first, right=True)) if first else 0
        return placed.dest[lo : int(torch.searchsorted(ends, first + rows, right=True))]

    def land(self, g: int, j: int, first: int, rows: int) -> tuple[torch.Tensor, Then]:
        """Where rows ``first ..`` of group ``g``'s leaf ``j`` are received, and what runs once they have come."""
        leaf = self.layouts[g].leaves[j]
        nbytes = rows * leaf.row_nbytes
        self.pieces += 1
        if not self.started:
            if not self.placed.done() and self.early_bytes + nbytes <= self.EARLY_BYTES:
                into = torch.empty(nbytes, dtype=torch.uint8)
                self.early.append((g, j, first, rows, into))
                self.early_bytes += nbytes
                self.early_pieces += 1
                return into, None
            self._start()
            if self.early and self.where is not None:
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

    def _land_now(self, g: int, j: int, first: int, rows: int, leaf: Leaf, nbytes: int) -> tuple[torch.Tensor, Then]:
        if self.where is not None:
            placed = self.where[g]
            d = placed.leaf_dest[j][first : first + rows]
            buf = values_of(placed.buffers[j])
            mark = self._done(g, j, first, rows, placed)
            start = run_start(d)
            if start is not None:  # one run: straight into place
                return as_bytes(buf[start : start + rows]), lambda: placed.mark_landed(mark)
        i = self.turn
        self.turn ^= 1
        if self.staging[i].numel() < nbytes:
            self.staging[i] = torch.empty(nbytes, dtype=torch.uint8)
        into = self.staging[i][:nbytes]
        if self.where is None:
            return into, None

        def scatter() -> None:
            scatter_rows(buf, d, into.view(leaf.dtype).view(rows, *leaf.shape))
            placed.mark_landed(mark)

        return into, scatter
