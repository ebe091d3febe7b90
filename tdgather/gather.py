"""`gather`: every rank's predictions to one CPU process, without pickle.

Call order, on every rank of the group:

1. every rank agrees on the call (`tdgather.transport.begin_call`: call number, dst);
2. each rank packs its predictions (`tdgather.store`, `tdgather.wire.pack`);
3. each sender posts ``data`` (if it holds frames) then ``done``, or ``error``
   when its own input was bad, then waits for rank ``dst``'s answer (past its
   heartbeats), then for its sends;
4. rank ``dst`` receives every peer's stream on its own thread (receives name
   their source), while it packs its own frames and sends heartbeats to the peers;
5. rank ``dst`` merges (`tdgather.merge`, lowest rank first) and answers each peer
   ``done`` or ``error``, so a failure anywhere raises on every rank instead of hanging;
6. rank ``dst`` returns the merged dict; the others return None.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .duplicates import DuplicateCounts, DuplicatePolicy
from .errors import FrameConflictError, PeerLostError, ProtocolError, TdgatherError
from .frames import Frames, Part
from .merge import merge
from .store import FrameStore, as_store
from .transport import Answers, Channel, as_timeout, begin_call, heartbeat_interval, peer_error, transport_group
from .wire import Kind, error_header, local_parts, pack, unpack

__all__ = ["GatherStats", "Gathered", "gather"]


@dataclass(frozen=True)
class GatherStats:
    """What one `gather` moved.

    Attributes:
        frames: frames in the result.
        bytes: tensor bytes received (every copy, duplicates included).
        duplicates_dropped: copies of a frame dropped (``duplicates.exact + duplicates.inexact``).
        frames_per_rank: frames each rank sent.
        seconds: the call's duration on rank ``dst``.
        duplicates: the copies dropped, exact and inexact, with the largest absolute difference.
    """

    frames: int
    bytes: int
    duplicates_dropped: int
    frames_per_rank: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    duplicates: DuplicateCounts = field(default_factory=DuplicateCounts)


class Gathered(dict[str, Frames]):
    """The gathered ``{filename: Frames}``, sorted by filename, with ``stats``."""

    stats: GatherStats


def gather(
    predictions: FrameStore | Mapping[str, Any],
    *,
    dst: int = 0,
    group: Any = None,
    timeout: float | timedelta | None = None,
    duplicates: str | DuplicatePolicy = "keep",
) -> Gathered | None:
    """Gather every rank's frames to rank ``dst``, as CPU tensors, ordered per filename.

    Args:
        predictions: ``{filename: (frame_idx, value)}``, ``{filename: [(frame_idx, value), ...]}``
            or a `FrameStore`. Values are tensors (CPU or CUDA), or dicts / TensorDicts /
            tensorclasses of tensors. Any rank may hold nothing.
        dst: the group rank that receives.
        group: the process group (default: the world). NCCL groups get a side gloo group.
        timeout: seconds (or a timedelta) any single wait may take; default 30 minutes. Every rank
            must enter ``gather`` within it of the others (ranks that finish far apart: use a
            `Collector`). Once a rank has sent, it waits for rank ``dst`` as long as that is alive.
        duplicates: what to do with copies of one ``(filename, frame_idx)``: ``"keep"`` one (the
            lowest rank's) and count it, ``"exact"`` (raise on any bit difference), or
            ``DuplicatePolicy("close", rtol=..., atol=...)`` (raise beyond the tolerance).

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
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return _result([local_parts(as_store(predictions), 0)], start, [0], policy)
    pg = transport_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    if not 0 <= dst < world:
        raise ValueError(f"dst: expected a group rank in 0..{world - 1}, got {dst}")
    call = begin_call(pg, "gather", dst, wait)
    try:
        if rank != dst:
            _send(predictions, call.channel(dst))
            return None
        channels = {p: call.channel(p) for p in range(world) if p != rank}
        return _receive(predictions, rank, channels, start, policy, heartbeat_interval(wait))
    finally:
        call.end()


def _send(predictions: Any, ch: Channel) -> None:
    failure = None
    try:
        store = as_store(predictions)
        data = pack(store) if len(store) else None
    except Exception as e:  # bad input here: tell dst, so nobody waits for frames that never come
        failure = e
    try:
        if failure is not None:
            works = ch.send(Kind.ERROR, error_header(failure))
        else:
            works = ch.send(Kind.DATA, *data) if data else []
            works += ch.send(Kind.DONE, {"frames": len(store)})
        # dst answers once it has read every stream (heartbeats until then), or at once when it
        # has failed: then the sends may never complete, so the answer is read first, and they after
        answer = ch.recv_answer()
        if answer.kind == Kind.DONE:
            ch.wait(works, "sending to the destination")
    except TdgatherError:
        if failure is not None:  # the user's own error matters more than the lost destination
            raise failure from None
        raise
    if failure is not None:
        raise failure
    if answer.kind == Kind.ERROR:
        raise peer_error(ch.peer, answer.header)


def _receive_stream(ch: Channel, parts: list[Part]) -> None:
    """Read one peer's stream into ``parts`` (kept by the caller, so a failure loses nothing received)."""
    frames = 0
    while True:
        msg = ch.recv()
        if msg.kind == Kind.DATA:
            parts += unpack(msg.header, msg.payload, ch.peer)
            frames += msg.header.num_frames
        elif msg.kind == Kind.ERROR:
            raise peer_error(ch.peer, msg.header)
        else:
            if msg.header["frames"] != frames:
                raise ProtocolError(
                    ch.peer, "done.frames", f"expected {frames} (frames received), got {msg.header['frames']}"
                )
            return


def _receive(
    predictions: Any, rank: int, channels: dict[int, Channel], start: float, policy: Any, heartbeat: float
) -> Gathered:
    errors: dict[int, BaseException] = {}
    parts: dict[int, list[Part]] = {r: [] for r in sorted([rank, *channels])}
    answers = Answers(channels, heartbeat).start()
    with ThreadPoolExecutor(max_workers=len(channels), thread_name_prefix="tdgather-recv") as pool:
        futures = {peer: pool.submit(_receive_stream, ch, parts[peer]) for peer, ch in channels.items()}
        try:
            parts[rank] = local_parts(as_store(predictions), rank)
        except Exception as e:
            errors[-1] = e
        for peer, fut in futures.items():
            try:
                fut.result()
            except Exception as e:
                errors[peer] = e
                if isinstance(e, PeerLostError):
                    answers.lost.add(peer)  # its pair is unusable
    result = None
    try:  # also after a peer's failure: the error carries what arrived
        result = _result(list(parts.values()), start, list(parts), policy)
    except Exception as e:
        errors.setdefault(-1, e)  # (a failing peer is reported first; then rank dst's own error)
        if isinstance(e, FrameConflictError):  # keep what arrived, one copy per frame
            with contextlib.suppress(FrameConflictError):
                result = _result(list(parts.values()), start, list(parts), DuplicatePolicy("keep"))
    failure = errors[min(errors, key=lambda r: (r < 0, r))] if errors else None
    if failure is None:
        answers.answer_all(Kind.DONE, lambda peer: {"frames": sum(p.num_frames for p in parts[peer])})
    else:
        answers.answer_all(Kind.ERROR, error_header(failure))
    answers.stop()
    if failure is not None:
        if isinstance(failure, TdgatherError):
            failure.received = result  # nothing received is lost: the caller can still save it
        raise failure
    return result


def _result(parts: list[list[Part]], start: float, ranks: list[int], policy: Any) -> Gathered:
    flat = [p for ps in parts for p in ps]  # lowest rank first: its copy of a duplicate is kept
    merged = merge(flat, policy)
    per_rank = dict.fromkeys(ranks, 0)
    for p in flat:
        per_rank[p.rank] = per_rank.get(p.rank, 0) + p.num_frames
    out = Gathered(merged.files)
    out.stats = GatherStats(
        frames=sum(f.frame_idx.numel() for f in merged.files.values()),
        bytes=sum(p.nbytes for p in flat),
        duplicates_dropped=merged.duplicates.dropped,
        frames_per_rank=dict(sorted(per_rank.items())),
        seconds=time.perf_counter() - start,
        duplicates=merged.duplicates,
    )
    return out
