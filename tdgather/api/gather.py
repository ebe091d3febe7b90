"""`gather`: every rank's predictions to one CPU process, without pickle.

Call order, on every rank of the group:

1. every rank agrees on the call (`tdgather.comm.transport.begin_call`: call number, dst); rank
   ``dst`` posts each sender a ready answer: its host, and the shared memory its result will be
   placed in (`tdgather.comm.direct`);
2. each sender reads it and posts its frames (`tdgather.comm.pack`, `tdgather.comm.protocol.send_frames`):
   a data message with its frame index, the pieces, then ``done`` (or ``error`` when its own input
   was bad); then it waits for rank ``dst``'s answer (past its heartbeats), then for its sends. A
   sender on rank ``dst``'s host with large fixed-size frames sends no pieces: its data message
   says ``direct``, and once rank ``dst`` answers where its rows go, it copies them there itself;
3. rank ``dst`` reads every peer's data message on the peer's own thread (receives name their
   source) and sends heartbeats to the peers;
4. with every frame index in hand, rank ``dst`` plans every row's place (`tdgather.core.plan`) and
   allocates the result once (in that shared memory when a sender writes there itself, and tells
   it where); each other peer's pieces then land there, straight into place where
   their rows form one run, else through two reused buffers and a scatter that overlaps the
   next piece's transfer; rank ``dst``'s own frames are scattered meanwhile;
5. rank ``dst`` compares duplicates (`tdgather.core.duplicates` policy) and answers each peer
   ``done`` or ``error``, so a failure anywhere raises on every rank instead of hanging;
6. rank ``dst`` returns a `Gathered` mapping, whose `Frames` are built on first access; the
   others return None.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..comm.direct import ResultMemory, Target, fixed_size, result_nbytes
from ..comm.pack import Packed, pack
from ..comm.protocol import (
    Joiner,
    end_stream,
    expect_done,
    read_frames,
    read_pieces,
    send_frames,
    send_pieces,
)
from ..comm.transport import (
    Answers,
    Channel,
    Message,
    as_timeout,
    begin_call,
    heartbeat_interval,
    peer_error,
    resolve_dst,
    transport_group,
)
from ..comm.wire import DataHeader, Kind, error_header
from ..core.duplicates import DuplicateCounts, DuplicatePolicy
from ..core.framestore import FrameStore, as_store
from ..core.gcpause import collection_paused
from ..core.merge import merge
from ..core.part import Part
from ..core.plan import Group, Mismatches, Placement, joined_chunks, keep_first_layouts, place, scatter_chunks
from ..core.promote import unify
from ..core.ragged import Ragged
from ..errors import FrameConflictError, PeerLostError, ProtocolError, TdgatherError
from .gathered import Gathered, GatherStats
from .landing import Landing, Placed

__all__ = ["GatherStats", "Gathered", "gather"]


def gather(
    predictions: FrameStore | Mapping[str, Any],
    *,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
    timeout: float | timedelta | None = None,
    duplicates: str | DuplicatePolicy = "keep",
    ragged: bool | str | Iterable[str] = (),
) -> Gathered | None:
    """Gather every rank's frames to rank ``dst``, as CPU tensors, ordered per filename.

    Args:
        predictions: ``{filename: (frame_idx, value)}``, ``{filename: [(frame_idx, value), ...]}``
            or a `FrameStore`. Values are tensors (CPU or CUDA), or dicts / TensorDicts /
            tensorclasses of tensors. Any rank may hold nothing.
        dst: the global rank that receives (as in ``torch.distributed.gather``); with neither
            ``dst`` nor ``group_dst``, global rank 0.
        group: the process group (default: the world). NCCL groups get a side gloo group.
        group_dst: instead of ``dst``, the receiver's rank within ``group``.
        timeout: seconds (or a timedelta) any single wait may take; default 30 minutes. Every rank
            must enter ``gather`` within it of the others (ranks that finish far apart: use a
            `Collector`). Once a rank has sent, it waits for rank ``dst`` as long as that is alive.
        duplicates: what to do with copies of one ``(filename, frame_idx)``: ``"keep"`` one (the
            lowest rank's) and count it, ``"exact"`` (raise on any bit difference), or
            ``DuplicatePolicy("close", rtol=..., atol=...)`` (raise beyond the tolerance).
        ragged: for a dict of predictions, the leaves that are ragged even where every frame has the
            same first dim: dotted keys, or True for every leaf (`FrameStore.add` explains). Not
            needed for a leaf whose first dim changes (boxes ``[N_i, 4]``): it is made ragged where
            that is found, on any rank. False (on every rank) declares every leaf fixed: a first
            dim that changes is then a `ShapeMismatchError`.

    Returns:
        On ``dst``, a `Gathered` dict ``{filename: Frames}``; elsewhere None. With torch.distributed
        not initialised, or one rank, the local frames, with no distributed calls.

    Raises:
        PeerError: a rank failed (its error type and message are carried); PeerLostError if it died
            or stopped answering. Other ranks see a PeerError naming ``dst``.
        ProtocolError: a peer's bytes broke the wire contract.
        ShapeMismatchError, DuplicateFrameError: frames of a filename do not agree.
        CallMismatchError: the ranks are not in the same call (another ``dst``, a skipped call).
        UnsupportedValueError: a value tdgather cannot carry (raised where it was given).

        On ``dst``, every error from a peer or from merging carries in ``.received`` every frame
        that did arrive (merged with the ``"keep"`` policy), so nothing received is lost.
    """
    start = time.perf_counter()
    wait = as_timeout(timeout)
    policy = DuplicatePolicy.of(duplicates)
    dst = resolve_dst(group, dst, group_dst)  # from here on, a rank of the group
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        with collection_paused():
            return _Receive(predictions, 0, {}, policy, start, ragged=ragged).local()
    pg = transport_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    call = begin_call(pg, "gather", dst, wait)
    try:
        if rank != dst:
            _send(predictions, call.channel(dst), ragged)
            return None
        channels = {p: call.channel(p) for p in range(world) if p != rank}
        memory = ResultMemory()
        readies = _post_ready(channels, memory)  # before any heartbeat: each sender's first message
        answers = Answers(channels, heartbeat_interval(wait)).start()
        try:
            grace = wait.total_seconds() / 2
            with collection_paused():
                receive = _Receive(predictions, rank, channels, policy, start, grace, ragged)
                return receive.run(answers, memory, readies)
        finally:
            answers.stop()
            memory.close()
    finally:
        call.end()


def _post_ready(channels: dict[int, Channel], memory: ResultMemory) -> dict[int, list | PeerLostError]:
    """Post every sender the ready answer; per peer, the works to wait for (or the error posting met)."""
    header = {"frames": 0, **memory.ready()}
    readies: dict[int, list | PeerLostError] = {}
    for peer, ch in channels.items():
        try:
            readies[peer] = ch.send(Kind.DONE, header)
        except PeerLostError as e:
            readies[peer] = e
    return readies


def _send(predictions: FrameStore | Mapping[str, Any], ch: Channel, ragged: bool | str | Iterable[str] = ()) -> None:
    failure = None
    try:
        with collection_paused():
            packed = pack(as_store(predictions, ragged))
    except Exception as e:  # bad input here: tell dst, so nobody waits for frames that never come
        failure = e
    target = None
    try:
        answer = ch.recv_answer()  # rank dst's ready: its host, and where a same-host sender may write
        if answer.kind == Kind.DONE:
            if failure is not None:
                works, answer = end_stream(ch, error=failure), None
            else:
                target = Target.open(answer.header, packed.parts)
                works, failure, answer = _post(ch, packed, target)
            # dst answers once it has read every stream (heartbeats until then), or at once when it
            # has failed: then the sends may never complete, so the answer is read first, and they after
            answer = answer or ch.recv_answer()
            if answer.kind == Kind.DONE:
                ch.wait(works, "sending to the destination")
    except TdgatherError:
        if failure is not None:  # the user's own error matters more than the lost destination
            raise failure from None
        raise
    finally:
        if target is not None:
            target.close()
    if failure is not None:
        raise failure
    if answer.kind == Kind.ERROR:
        raise peer_error(ch, answer.header)


def _post(ch: Channel, packed: Packed, target: Target | None) -> tuple[list, BaseException | None, Message | None]:
    """Post a sender's frames, and ``done``: the works, a failure of its own, and rank dst's answer if it came.

    With a ``target`` (rank dst's result memory, on this host), the data message asks to write in
    place; rank dst answers where the rows go (they are copied there), or None (they go as pieces).
    """
    if target is None:
        return send_frames(ch, packed, Joiner(reuse=False)) + end_stream(ch, packed.frames), None, None
    works = ch.send(Kind.DATA, {**packed.header, "direct": True}, packed.index)
    answer = ch.recv_answer()
    if answer.kind == Kind.ERROR:  # rank dst failed before it placed: its answer came instead
        return works, None, answer
    try:
        if "place" not in answer.header:
            got = sorted(answer.header)
            raise ProtocolError(ch.peer, "header.place", f"expected where this rank's rows go, got {got}")
        if answer.header["place"] is None:
            works += send_pieces(ch, packed, Joiner(reuse=False))
        else:
            target.write(answer.header["place"], packed.parts, ch.peer)
    except (ProtocolError, OSError, RuntimeError) as e:  # rank dst hears why, and keeps what the others sent
        return works + end_stream(ch, error=e), e, None
    return works + end_stream(ch, packed.frames), None, None


class _Receive:
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
        self.answers, self.memory, self.readies = answers, memory, readies
        with ThreadPoolExecutor(max_workers=len(self.channels), thread_name_prefix="tdgather-recv") as pool:
            futures = {peer: pool.submit(self._read_peer, peer) for peer in self.channels}
            try:
                self.parts[self.rank] = own = as_store(self.predictions, self.ragged).parts(self.rank)
                for part in own:  # while the peers' frame indexes come: many small batches joined now
                    part.chunks = joined_chunks(part.chunks, len(part.layout.leaves))
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
            for p in writers:
                placed = [self.where[(p, id(q))] for q in self.parts[p]]
                buffers = [q.buffers for q in placed]  # each part's own entry: numbered as the parts are
                self.places[p] = self.memory.place(buffers, [(i, q.dest) for i, q in enumerate(placed)])

    def _land_local(self) -> None:
        for part in self.parts[self.rank]:
            placed = self.where.get((self.rank, id(part)))
            if placed is not None:
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

    def _gathered(self, groups: list[Group], found: DuplicateCounts) -> Gathered:
        per_rank = {r: sum(p.num_frames for p in ps) for r, ps in self.parts.items()}
        all_parts = [p for ps in self.parts.values() for p in ps]
        stats = GatherStats(
            frames=sum(g.num_frames for g in groups),
            bytes=sum(p.nbytes for p in all_parts),
            duplicates_dropped=found.dropped,
            frames_per_rank=per_rank,
            seconds=time.perf_counter() - self.start,
            duplicates=found,
            pieces=sum(n for n, _ in self.pieces.values()),
            early_pieces=sum(n for _, n in self.pieces.values()),
            written_in_place=len(self.wrote),
        )
        return Gathered(groups, stats)
