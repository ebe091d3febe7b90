"""`gather`: every rank's predictions to one CPU process, without pickle.

Call order, on every rank of the group:

1. each rank packs its predictions (`tdgather.store`, `tdgather.wire.pack`);
2. each sender posts ``data`` (if it holds frames) then ``done``, or ``error``
   when its own input was bad, and waits until its sends complete;
3. rank ``dst`` receives every peer's stream on its own thread (receives name
   their source), while it packs its own frames;
4. rank ``dst`` merges (`tdgather.merge`) and answers each peer ``done`` or
   ``error``, so a failure anywhere raises on every rank instead of hanging;
5. rank ``dst`` returns the merged dict; the others return None.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .errors import PeerError, PeerLostError, ProtocolError, TdgatherError
from .frames import Frames, Part
from .merge import merge
from .store import FrameStore, as_store
from .transport import Channel, as_timeout, transport_group
from .wire import Kind, error_header, local_parts, pack, unpack

__all__ = ["GatherStats", "Gathered", "gather"]


@dataclass(frozen=True)
class GatherStats:
    """What one `gather` moved."""

    frames: int
    bytes: int
    duplicates_dropped: int
    frames_per_rank: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0


class Gathered(dict[str, Frames]):
    """The gathered ``{filename: Frames}``, sorted by filename, with ``stats``."""

    stats: GatherStats


def gather(
    predictions: FrameStore | Mapping[str, Any],
    *,
    dst: int = 0,
    group: Any = None,
    timeout: float | timedelta | None = None,
) -> Gathered | None:
    """Gather every rank's frames to rank ``dst``, as CPU tensors, ordered per filename.

    Args:
        predictions: ``{filename: (frame_idx, value)}``, ``{filename: [(frame_idx, value), ...]}``
            or a `FrameStore`. Values are tensors (CPU or CUDA), or dicts / TensorDicts /
            tensorclasses of tensors. Any rank may hold nothing.
        dst: the group rank that receives.
        group: the process group (default: the world). NCCL groups get a side gloo group.
        timeout: seconds (or a timedelta) any single wait may take; default 30 minutes.

    Returns:
        On ``dst``, a `Gathered` dict ``{filename: Frames}``; elsewhere None. With torch.distributed
        not initialised, or one rank, the local frames, with no distributed calls.

    Raises:
        PeerError: a rank failed (its error type and message are carried); PeerLostError if it died
            or stopped answering. Other ranks see a PeerError naming ``dst``.
        ProtocolError: a peer's bytes broke the wire contract.
            On ``dst``, a `PeerError` or `ProtocolError` carries in ``.received`` every frame
            that did arrive (the failed rank's complete messages and the other ranks' data).
        ShapeMismatchError, DuplicateFrameError: frames of a filename do not agree.
        UnsupportedValueError: a value tdgather cannot carry (raised where it was given).
    """
    start = time.perf_counter()
    wait = as_timeout(timeout)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return _result([local_parts(as_store(predictions), 0)], start, [0])
    pg = transport_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    if not 0 <= dst < world:
        raise ValueError(f"dst: expected a group rank in 0..{world - 1}, got {dst}")
    if rank != dst:
        _send(predictions, Channel(pg, dst, wait))
        return None
    return _receive(predictions, rank, {p: Channel(pg, p, wait) for p in range(world) if p != rank}, start)


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
        # dst answers once it has read every stream (it may wait up to the timeout for a stopped
        # peer, so the answer may take twice the timeout), or at once when it has failed: then the
        # sends may never complete, so the answer is read first, and they are waited after
        answer = ch.recv(first_wait=2 * ch.timeout)
        if answer.kind == Kind.DONE:
            ch.wait(works, "sending to the destination")
    except TdgatherError:
        if failure is not None:  # the user's own error matters more than the lost destination
            raise failure from None
        raise
    if failure is not None:
        raise failure
    if answer.kind == Kind.ERROR:
        raise PeerError(ch.peer, answer.header["type"], answer.header["message"])


def _receive_stream(ch: Channel, parts: list[Part]) -> None:
    """Read one peer's stream into ``parts`` (kept by the caller, so a failure loses nothing received)."""
    frames = 0
    while True:
        msg = ch.recv()
        if msg.kind == Kind.DATA:
            parts += unpack(msg.header, msg.payload, ch.peer)
            frames += msg.header.num_frames
        elif msg.kind == Kind.ERROR:
            raise PeerError(ch.peer, msg.header["type"], msg.header["message"])
        else:
            if msg.header["frames"] != frames:
                raise ProtocolError(
                    ch.peer, "done.frames", f"expected {frames} (frames received), got {msg.header['frames']}"
                )
            return


def _receive(predictions: Any, rank: int, channels: dict[int, Channel], start: float) -> Gathered:
    errors: dict[int, BaseException] = {}
    parts: dict[int, list[Part]] = {r: [] for r in sorted([rank, *channels])}
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
    result = None
    try:  # also after a peer's failure: the error carries what arrived
        result = _result(list(parts.values()), start, list(parts))
    except Exception as e:
        errors.setdefault(-1, e)  # rank dst's own input error, if any, comes first
    failure = errors[min(errors, key=lambda r: (r < 0, r))] if errors else None
    for peer, ch in channels.items():
        if isinstance(errors.get(peer), PeerLostError):
            continue  # its pair is unusable
        received = sum(p.num_frames for p in parts[peer])
        answer = (Kind.DONE, {"frames": received}) if failure is None else (Kind.ERROR, error_header(failure))
        try:
            ch.wait(ch.send(*answer), "answering the peer")
        except PeerLostError as e:
            errors.setdefault(peer, e)
    if failure is not None:
        if isinstance(failure, TdgatherError):
            failure.received = result  # nothing received is lost: the caller can still save it
        raise failure
    return result


def _result(parts: list[list[Part]], start: float, ranks: list[int]) -> Gathered:
    flat = [p for ps in parts for p in ps]
    merged, dropped = merge(flat)
    per_rank = dict.fromkeys(ranks, 0)
    for p in flat:
        per_rank[p.rank] = per_rank.get(p.rank, 0) + p.num_frames
    out = Gathered(merged)
    out.stats = GatherStats(
        frames=sum(f.frame_idx.numel() for f in merged.values()),
        bytes=sum(p.nbytes for p in flat),
        duplicates_dropped=dropped,
        frames_per_rank=dict(sorted(per_rank.items())),
        seconds=time.perf_counter() - start,
    )
    return out
