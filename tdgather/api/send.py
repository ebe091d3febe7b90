"""A sender's side of one `tdgather.gather`: its frames posted to rank dst, then rank dst's answer awaited.

`send` packs the frames (`tdgather.comm.pack`) and reads rank dst's ready answer; then it posts a
data message with its frame index, the pieces, then ``done`` (or ``error`` when its own input was
bad), and waits for rank dst's answer (past its heartbeats), then for its sends: step 2 of
`tdgather.api.gather`'s call order. A sender on rank dst's host with large fixed-size frames sends
no pieces: it copies its rows where rank dst answers they go (`tdgather.comm.direct`). A
`tdgather.Collector`'s senders are `tdgather.api.sending`'s links.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..comm.direct import Target
from ..comm.pack import Packed, pack
from ..comm.protocol import Joiner, end_stream, send_frames, send_pieces
from ..comm.transport import Channel, Message, peer_error
from ..comm.wire import Kind
from ..core.framestore import FrameStore, as_store
from ..core.gcpause import collection_paused
from ..errors import ProtocolError, TdgatherError

__all__ = ["send"]


def send(predictions: FrameStore | Mapping[str, Any], ch: Channel, ragged: bool | str | Iterable[str] = ()) -> None:
    """Post this rank's frames to rank dst on ``ch``, then wait for its answer; raise its error, or this rank's own.

    The cyclic collector is paused throughout, as on rank dst: packing allocates objects a filename,
    and writing in place one a run of rows (a full collection set off in the write cost a sender of
    157 MB of 48 KiB frames 0.2 s, a page fault on each page of the objects it walked).
    """
    with collection_paused():
        _send(predictions, ch, ragged)


def _send(predictions: FrameStore | Mapping[str, Any], ch: Channel, ragged: bool | str | Iterable[str]) -> None:
    failure = None
    try:
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
