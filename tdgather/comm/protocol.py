"""The message protocol of one sender's stream, shared by `tdgather.api.gather` and `tdgather.Collector`.

A sender's stream is, in order: any number of (``data`` message, its ``piece`` messages), then
``done`` (its frame count) or ``error`` (type and message, as JSON). A ``data`` message with no
groups is a heartbeat. Rank dst answers each sender ``done`` or ``error`` once, and sends it
heartbeats until then (`tdgather.comm.transport.Answers`).

- `send_frames` posts a packed store (`tdgather.comm.pack`): the data message, then each piece, a
  batch as the sender holds it or small batches joined; to a peer on the same host, the pieces
  written into one shared memory file instead, named in the data message (`tdgather.comm.shm`);
- `read_pieces` receives the pieces of a data message where rank dst wants them (``land``),
  running the previous piece's scatter while the next is on the wire;
- `read_frames` receives them into new buffers, in the sender's row order (the Collector);
- `end_stream` and `expect_done` end a stream and check its end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.frames import Layout, Leaf
from ..core.part import Part
from ..errors import ProtocolError
from .arena import Arena
from .pack import PIECE_MIN, PIECE_TARGET, Packed
from .shm import ShmWriter, open_shm
from .transport import Channel, Message, peer_error
from .wire import DataHeader, Kind, error_header, shm_offsets

__all__ = ["Joiner", "end_stream", "expect_done", "read_frames", "read_pieces", "send_frames", "send_pieces"]

Land = Callable[[int, int, int, int], tuple[torch.Tensor, Callable[[], None] | None]]


class Joiner:
    """Joins a piece's small batches into one buffer: new ones, or (``reuse``) two that take turns.

    A reused buffer is written again only once its previous send completed. gloo counts a send
    complete once per wait, so each send is waited exactly once: here, or in `wait`.
    """

    def __init__(self, reuse: bool) -> None:
        self.reuse = reuse
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._works: list[list] = [[], []]
        self._turn = 0

    def join(self, ch: Channel, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The batches (one leaf's rows) joined into one, as bytes."""
        if not self.reuse:
            return as_bytes(torch.cat(tensors))
        self._turn ^= 1
        ch.wait(self._works[self._turn], "a piece")
        self._works[self._turn] = []
        n = sum(t.numel() * t.element_size() for t in tensors)
        buf = self._buffers[self._turn]
        if buf is None or buf.numel() < n:
            buf = self._buffers[self._turn] = torch.empty(max(n, PIECE_TARGET + PIECE_MIN), dtype=torch.uint8)
        first = tensors[0]
        torch.cat(tensors, out=buf[:n].view(first.dtype).view(-1, *first.shape[1:]))
        return buf[:n]

    def sent(self, works: list) -> list:
        """Record the works of the piece just joined; return those the caller must wait for."""
        if not self.reuse:
            return works
        self._works[self._turn] = works
        return []

    def wait(self, ch: Channel) -> None:
        """Wait for every send of a reused buffer."""
        for k in (0, 1):
            ch.wait(self._works[k], "a piece")
            self._works[k] = []


def send_frames(
    ch: Channel, packed: Packed, joiner: Joiner, shm: ShmWriter | None = None, arena: Arena | None = None
) -> list:
    """Post a packed store: its data message, then every piece; return the works to wait for.

    Sends of joined pieces in reused buffers are the joiner's to wait for (`Joiner.wait`). With
    ``shm`` (the peer shares this host), the pieces go into an shm file instead, when one can be made:
    the store's ``arena``'s, when its batches were copied there as the message lays them out.
    """
    if shm is not None and packed.pieces:
        offsets, size = _piece_offsets(packed.header)
        pieces = [[as_bytes(t.contiguous()) for t in p] for p in packed.pieces]
        written = shm.write(pieces, offsets, size, arena)
        if written is not None:
            name, keep = written
            shm = {"name": name, "size": size, **({"keep": True} if keep else {})}
            return ch.send(Kind.DATA, {**packed.header, "shm": shm}, packed.index)
    return ch.send(Kind.DATA, packed.header, packed.index) + send_pieces(ch, packed, joiner)


def send_pieces(ch: Channel, packed: Packed, joiner: Joiner) -> list:
    """Post the pieces of a packed store (its data message was sent); return the works to wait for."""
    works: list = []
    for piece in packed.pieces:
        if len(piece) == 1:
            works += ch.send(Kind.PIECE, None, as_bytes(piece[0].contiguous()))
        else:
            works += joiner.sent(ch.send(Kind.PIECE, None, joiner.join(ch, piece)))
    return works


def end_stream(ch: Channel, frames: int | None = None, error: BaseException | None = None, **more: Any) -> list:
    """Post the end of a stream: ``done`` with the frames sent (and ``more``: a writer's ``part``), or ``error``."""
    if error is not None:
        return ch.send(Kind.ERROR, error_header(error))
    return ch.send(Kind.DONE, {"frames": frames, **more})


def _piece_offsets(header: dict) -> tuple[list[int], int]:
    """Where each piece of a packed header goes in an shm file (in piece order), and the shm file's size."""
    groups = [(Layout.from_json(g["layout"]), tuple(g["elems"])) for g in header["groups"]]
    starts, size = shm_offsets(groups)
    out, k = [], 0
    for (layout, _), g in zip(groups, header["groups"], strict=True):
        for leaf, counts in zip(layout.leaves, g["pieces"], strict=True):
            at = starts[k]
            for rows in counts:
                out.append(at)
                at += rows * leaf.row_nbytes
            k += 1
    return out, size


def shm_columns(ch: Channel, header: DataHeader) -> list[list[torch.Tensor]]:
    """Per group, per tensor leaf: its rows in the data message's shm file (views of its mapping)."""
    name, size, keep = header.shm
    data = open_shm(name, size, ch.peer, keep)
    starts, _ = shm_offsets([(g.layout, g.elems) for g in header.groups])
    out, k = [], 0
    for g in header.groups:
        columns = []
        for leaf, n in zip(g.layout.leaves, g.elems, strict=True):
            nbytes = n * leaf.row_nbytes
            if nbytes:
                columns.append(data[starts[k] : starts[k] + nbytes].view(leaf.dtype).view(n, *leaf.shape))
            else:  # no bytes (n rows of zero size): nothing to view
                columns.append(torch.empty((n, *leaf.shape), dtype=leaf.dtype))
            k += 1
        out.append(columns)
    return out


def read_pieces(ch: Channel, header: DataHeader, land: Land) -> None:
    """Receive the pieces that follow ``header`` (or copy them from its shm file).

    ``land(group, leaf, first_row, rows)`` gives the uint8 tensor a piece is received into and
    what to run once it is there (or None); that runs while the next piece is on the wire, so it
    must not touch the next piece's tensor.
    """
    if header.shm is not None:
        columns = shm_columns(ch, header)
        for g, j, first, rows in header.pieces():
            into, then = land(g, j, first, rows)
            into.copy_(as_bytes(columns[g][j][first : first + rows]))
            if then is not None:
                then()
        return
    pending = None
    for g, j, first, rows in header.pieces():
        into, then = land(g, j, first, rows)
        ch.recv_piece(into, pending)
        pending = then
    if pending is not None:
        pending()


def read_frames(ch: Channel, msg: Message, take: Callable[[int], torch.Tensor] | None = None) -> list[Part]:
    """The parts of data message ``msg``, its pieces received in the sender's row order.

    Each leaf's rows land in one buffer: new, or from ``take(nbytes)`` (a uint8 tensor of at least that).
    """
    header = msg.header

    def column(rows: int, leaf: Leaf) -> torch.Tensor:
        if take is None:
            return torch.empty((rows, *leaf.shape), dtype=leaf.dtype)
        nbytes = rows * leaf.row_nbytes
        return take(nbytes)[:nbytes].view(leaf.dtype).view(rows, *leaf.shape)

    if header.shm is not None:  # the rows are in place already: views of the shm file, no copy
        columns = shm_columns(ch, header)
    else:  # a ragged leaf's column holds its values: elems rows
        columns = [[column(n, leaf) for n, leaf in zip(g.elems, g.layout.leaves, strict=True)] for g in header.groups]

        def land(g: int, j: int, first: int, rows: int) -> tuple[torch.Tensor, None]:
            return as_bytes(columns[g][j][first : first + rows]), None

        read_pieces(ch, header, land)
    files = list(header.files)
    return [
        Part(ch.peer, g.layout, files, ids, idx, list(g.json), [columns[k]], lengths)
        for k, (g, (ids, idx, lengths)) in enumerate(zip(header.groups, msg.index, strict=True))
    ]


def expect_done(ch: Channel, msg: Message, frames: int) -> None:
    """Check that ``msg`` ends the stream after ``frames`` frames; raise the peer's error if it is one."""
    if msg.kind == Kind.ERROR:
        raise peer_error(ch, msg.header)
    if msg.kind != Kind.DONE:
        raise ProtocolError(ch.peer, "prelude.kind", f"expected done (2) or error (3), got {int(msg.kind)}")
    if msg.header["frames"] != frames:
        raise ProtocolError(ch.peer, "done.frames", f"expected {frames} (frames received), got {msg.header['frames']}")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a uint8 view."""
    return t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
