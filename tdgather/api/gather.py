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

A sender's side is `tdgather.api.send`; rank ``dst``'s, `tdgather.api.receive`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..comm.direct import ResultMemory
from ..comm.groups import as_timeout, heartbeat_interval, resolve_dst, transport_group
from ..comm.transport import Answers, begin_call
from ..core.duplicates import DuplicatePolicy
from ..core.framestore import FrameStore
from ..core.gcpause import collection_paused
from .gathered import Gathered, GatherStats
from .receive import Receive, post_ready
from .send import send

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
            return Receive(predictions, 0, {}, policy, start, ragged=ragged).local()
    pg = transport_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    call = begin_call(pg, "gather", dst, wait)
    try:
        if rank != dst:
            send(predictions, call.channel(dst), ragged)
            return None
        channels = {p: call.channel(p) for p in range(world) if p != rank}
        memory = ResultMemory()
        readies = post_ready(channels, memory)  # before any heartbeat: each sender's first message
        answers = Answers(channels, heartbeat_interval(wait)).start()
        try:
            grace = wait.total_seconds() / 2
            with collection_paused():
                receive = Receive(predictions, rank, channels, policy, start, grace, ragged)
                return receive.run(answers, memory, readies)
        finally:
            answers.stop()
            memory.close()
    finally:
        call.end()
