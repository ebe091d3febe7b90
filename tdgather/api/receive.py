"""Rank dst's side of one `tdgather.gather`: the ready answers, then `Receive`.

`post_ready` posts each sender rank dst's ready answer (step 1 of `tdgather.api.gather`'s call
order). `Receive` reads each peer's data message on that peer's thread, places every row once every
frame index is in (`tdgather.core.plan`), lands each peer's pieces in the result
(`tdgather.api.landing`) or lets a peer on this host write its rows there itself, scatters rank
dst's own frames meanwhile, compares duplicates and answers each peer ``done`` or ``error`` (steps
3 to 6). When a frame index is late, or a leaf must be made ragged, every peer's frames are
received as they come and merged at the end instead (`tdgather.core.merge`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..comm.direct import ResultMemory, fixed_size, result_nbytes
from ..comm.protocol import expect_done, read_frames, read_pieces
from ..comm.transport import Answers, Channel, peer_error
from ..comm.wire import DataHeader, Kind, error_header
from ..core.duplicates import DuplicateCounts, DuplicatePolicy
from ..core.framestore import FrameStore, as_store
from ..core.merge import merge
from ..core.part import Part
from ..core.plan import Group, Mismatches, Placement, keep_first_layouts, place
from ..core.promote import unify
from ..core.ragged import Ragged
from ..core.scatter import scatter_chunks
from ..errors import FrameConflictError, PeerLostError, ProtocolError, TdgatherError
from .gathered import Gathered, GatherStats
from .landing import Landing, Placed

__all__ = ["Receive", "post_ready"]


def post_ready(channels: dict[int, Channel], memory: ResultMemory) -> dict[int, list | PeerLostError]:
    """Post every sender the ready answer; per peer, the works to wait for (or the error posting met)."""
    header = {"frames": 0, **memory.ready()}
    readies: dict[int, list | PeerLostError] = {}
    for peer, ch in channels.items():
        try:
            readies[peer] = ch.send(Kind.DONE, header)
        except PeerLostError as e:
            readies[peer] = e
    return readies


class Receive:
    """Rank dst's side of one gather: read the frame indexes, place, land the pieces, answer."""

    def __init__(
        self,
        predictions: FrameStore | Mapping[str, Any],
        rank: int,
        channels: dict[int, Channel],
        policy: DuplicatePolicy,
        start: float,
        grace: float = 0.0,
        ragged: bool | str | Iterable[str] = (),
    ) -> None:
        self.predictions, self.ragged, self.rank, self.channels = predictions, ragged, rank, channels
        self.fixed = ragged is False or bool(getattr(predictions, "fixed", False))  # no leaf made ragged
        self.policy, self.start = policy, start
        self.errors: dict[int, BaseException] = {}
        self.parts: dict[int, list[Part]] = {r: [] for r in sorted([rank, *channels])}
        self.planned = {p: threading.Event() for p in channels}
        self.decided = threading.Event()  # every frame index is in (or one is late): pieces may come
        # once placed: where each peer's parts went, one per group of its data message (None: nowhere)
        self.placed: dict[int, Future[list[Placed] | None]] = {p: Future() for p in channels}
        self.placements: list[tuple[Placement, list[Part]]] = []
        self.buffers: list[list[torch.Tensor | Ragged]] = []
        self.landed: list[torch.Tensor] = []
        self.where: dict[tuple[int, int], Placed] = {}  # (rank, id(part)) -> where its rows went
        self.discard = False  # placing failed: read the pieces only to keep the streams in step
        self.mismatches: Mismatches = {}  # filenames sent with two layouts: the first rank's is kept
        # a frame index still missing after this long: every peer's pieces are received as they
        # come and merged at the end, so that a straggler's timeout (which closes every gloo pair
        # of this rank) cannot cost the others' frames
        self.grace = grace
        self.late = False
        self.pieces: dict[int, tuple[int, int]] = {}  # per peer, received, and of them early: `GatherStats`
        self.memory: ResultMemory | None = None
        self.readies: dict[int, list | PeerLostError] = {}
        self.answers: Answers | None = None
        self.direct: set[int] = set()  # peers that asked to write their rows in place
        self.places: dict[int, dict] = {}  # ... and where rank dst placed them (the others send pieces)
        self.wrote: set[int] = set()  # ... and of those, the peers that wrote them all

    def local(self) -> Gathered:
        """No peers: place and merge rank dst's own frames."""
        self.parts[self.rank] = as_store(self.predictions, self.ragged).parts(self.rank)
        self.late = self._promotes()
        if not self.late:
            self._place()
            self._land_local()
        result = self._result()
        if self.mismatches:  # a filename with two layouts (frames declared fixed): what was given is carried
            error = next(iter(self.mismatches.values()))[1]
            error.received = result
            raise error
        return result

    def run(self, answers: Answers, memory: ResultMemory, readies: dict[int, list | PeerLostError]) -> Gathered:
        """With peers: read, place and land every peer's frames, answer each one, return the result.

        Raises the first failure (a peer's before rank dst's own), carrying in ``.received`` what arrived.
        """
        self.answers, self.memory, self.readies = answers, memory, readies
        with ThreadPoolExecutor(max_workers=len(self.channels), thread_name_prefix="tdgather-recv") as pool:
            futures = {peer: pool.submit(self._read_peer, peer) for peer in self.channels}
            try:
                self.parts[self.rank] = as_store(self.predictions, self.ragged).parts(self.rank)
            except Exception as e:
                self.errors[-1] = e
            deadline = time.monotonic() + self.grace
            for event in self.planned.values():
                event.wait(max(0.0, deadline - time.monotonic()))
            self.late = not all(event.is_set() for event in self.planned.values()) or self._promotes()
            self.decided.set()
            where: dict[int, list[Placed]] = {}
            try:
                if not self.late:
                    self._place()
                    where = {p: [self.where[(p, id(q))] for q in self.parts[p]] for p in self.channels}
            except Exception as e:
                self.errors.setdefault(-1, e)
                self.discard = True
            for peer, placed in self.placed.items():
                placed.set_result(None if self.discard else where.get(peer))
            if not (self.discard or self.late):
                self._land_local()
            for peer, fut in futures.items():
                try:
                    fut.result()
                except Exception as e:
                    self.errors[peer] = e
                    if isinstance(e, PeerLostError):
                        answers.lost.add(peer)  # its pair is unusable
        result = None
        if not self.discard:
            try:  # also after a peer's failure: the error carries what arrived
                result = self._result()
            except FrameConflictError as e:
                self.errors.setdefault(-1, e)
                self.policy = DuplicatePolicy("keep")  # keep what arrived, one copy per frame
                result = self._result()
            except Exception as e:
                self.errors.setdefault(-1, e)
        if self.mismatches:
            self.errors.setdefault(-1, next(iter(self.mismatches.values()))[1])
        failure = self.errors[min(self.errors, key=lambda r: (r < 0, r))] if self.errors else None
        if failure is None:
            answers.answer_all(Kind.DONE, lambda peer: {"frames": sum(p.num_frames for p in self.parts[peer])})
        else:
            answers.answer_all(Kind.ERROR, error_header(failure))
        if failure is not None:
            if isinstance(failure, TdgatherError):
                failure.received = result  # nothing received is lost: the caller can still save it
            raise failure
        return result

    def _read_peer(self, peer: int) -> None:
        ch = self.channels[peer]
        try:
            ready = self.readies.get(peer, [])
            if isinstance(ready, BaseException):
                raise ready
            msg = ch.recv()
            ch.wait(ready, "the ready answer")  # read by now: the sender reads it before it sends
            if msg.kind == Kind.ERROR:
                raise peer_error(ch, msg.header)
            if msg.kind != Kind.DATA:
                raise ProtocolError(peer, "prelude.kind", f"expected data (1) or error (3), got {int(msg.kind)}")
            self.parts[peer] = [
                Part(peer, g.layout, list(msg.header.files), ids, idx, list(g.json), lengths=lengths)
                for g, (ids, idx, lengths) in zip(msg.header.groups, msg.index, strict=True)
            ]
            if msg.header.direct:
                self.direct.add(peer)
        finally:
            self.planned[peer].set()
        self.decided.wait()
        if msg.header.direct and self._written_in_place(peer, ch, msg.header):
            return
        if self.late:  # no placement (a frame index came late): receive as it comes, merge at the end
            try:
                self.parts[peer] = read_frames(ch, msg)
            except BaseException:
                self.parts[peer] = []  # what it sent is not whole
                raise
        else:
            landing = Landing(msg.header, self.placed[peer])
            try:
                read_pieces(ch, msg.header, landing.land)
            except BaseException:
                landing.finish(last_whole=False)  # what arrived whole still lands
                raise
            else:
                landing.finish()
            finally:
                self.pieces[peer] = (landing.pieces, landing.early_pieces)
        expect_done(ch, ch.recv(), msg.header.num_frames)

    def _written_in_place(self, peer: int, ch: Channel, header: DataHeader) -> bool:
        """A peer that asked to write in place: tell it where and wait for its ``done`` (True).

        Or tell it to send pieces (False: they are read as any peer's).
        """
        placed = self.placed[peer].result()
        place = self.places.get(peer)
        assert self.answers is not None
        ch.wait(self.answers.post(peer, Kind.DONE, {"frames": 0, "place": place}), "the place answer")
        if place is None:
            return False
        expect_done(ch, ch.recv(), header.num_frames)  # its rows are all in place
        for p in placed or ():
            p.mark_landed(p.dest)
        self.wrote.add(peer)
        return True

    def _promotes(self) -> bool:
        """Whether a leaf must be made ragged (`unify`): then every frame is received as it comes and merged.

        Placing needs each row's size before it arrives, and a fixed leaf made ragged changes it.
        """
        if self.fixed:
            return False
        parts = [p for r in sorted(self.parts) for p in self.parts[r]]
        try:
            return any(q is not p for p, q in zip(parts, unify(parts), strict=True))
        except Exception:
            return True  # the merge at the end meets the error again, and reports it

    def _place(self) -> None:
        parts = [p for r in sorted(self.parts) for p in self.parts[r]]  # lowest rank first
        self.placements = place(parts, self.mismatches, fixed=self.fixed)
        # peers on this host that asked to write their rows into the result themselves: it is placed in
        # rank dst's shared memory (a peer with a ragged leaf is told to send pieces)
        writers = [p for p in sorted(self.direct) if fixed_size(self.parts[p])]
        shapes = [s for placement, _ in self.placements for s in placement.shapes()]
        rows = [q.num_frames for p in writers for q in self.parts[p]]
        in_memory = bool(writers) and self.memory is not None and self.memory.arena(result_nbytes(shapes, rows))
        for placement, members in self.placements:
            buffers = placement.allocate(empty=self.memory.take if in_memory else None)
            landed = torch.zeros(placement.num_frames + placement.kept.numel(), dtype=torch.bool)
            self.buffers.append(buffers)
            self.landed.append(landed)
            for part, dest, leaf_dest in zip(members, placement.dest, placement.leaf_dest, strict=True):
                self.where[(part.rank, id(part))] = Placed(part, buffers, landed, dest, leaf_dest)
        if in_memory:
            for k, p in enumerate(writers, 1):  # rank dst writes its own from its first row; writer k from k/(n+1)
                placed = [self.where[(p, id(q))] for q in self.parts[p]]
                buffers = [q.buffers for q in placed]  # each part's own entry: numbered as the parts are
                dests = [(i, q.dest) for i, q in enumerate(placed)]
                self.places[p] = self.memory.place(buffers, dests, first=k / (len(writers) + 1))

    def _land_local(self) -> None:
        for part in self.parts[self.rank]:
            placed = self.where.get((self.rank, id(part)))
            if placed is None:
                continue
            if self.memory is not None:
                self.memory.land(placed.buffers, placed.leaf_dest, part.chunks)
            else:
                scatter_chunks(placed.buffers, placed.leaf_dest, part.chunks)
            placed.mark_landed(placed.dest)

    def _result(self) -> Gathered:
        if self.late:
            parts = [p for r in sorted(self.parts) for p in self.parts[r]]  # lowest rank first
            merged = merge(parts, self.policy, mismatches=self.mismatches, fixed=self.fixed)
            return self._gathered(merged.groups, merged.duplicates)
        groups, found = [], DuplicateCounts()
        for (placement, _), buffers, landed in zip(self.placements, self.buffers, self.landed, strict=True):
            if bool(landed.all()):
                found += placement.check_duplicates(buffers, self.policy)
                groups.append(placement.group(buffers))
            else:  # a peer failed part-way: what landed, one copy per frame
                groups.append(placement.salvage(buffers, landed))
        return self._gathered(keep_first_layouts(groups, self.mismatches), found)

    def _arrived(self, rank: int, part: Part) -> tuple[int, int]:
        """A part's frames and tensor bytes that reached rank dst: those of its rows that landed.

        All of them, unless its sender failed part-way (then the result leaves the others out).
        """
        placed = None if self.late or not self.errors else self.where.get((rank, id(part)))
        if placed is None:  # nothing failed, or merged as it came: what is in the part arrived
            return part.num_frames, part.nbytes
        got = placed.landed[placed.dest]
        return int(got.sum()), part.nbytes_of(got)

    def _gathered(self, groups: list[Group], found: DuplicateCounts) -> Gathered:
        arrived = {r: [self._arrived(r, p) for p in ps] for r, ps in self.parts.items()}
        per_rank = {r: sum(n for n, _ in a) for r, a in arrived.items()}
        stats = GatherStats(
            frames=sum(g.num_frames for g in groups),
            bytes=sum(b for a in arrived.values() for _, b in a),
            duplicates_dropped=found.dropped,
            frames_per_rank=per_rank,
            seconds=time.perf_counter() - self.start,
            duplicates=found,
            pieces=sum(n for n, _ in self.pieces.values()),
            early_pieces=sum(n for _, n in self.pieces.values()),
            written_in_place=len(self.wrote),
        )
        return Gathered(groups, stats)
