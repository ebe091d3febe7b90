"""Stage 3, transport: a tdgather call on a group, and one ordered message stream per peer, over gloo.

`Channel` is the one place bytes move between ranks: the only code that calls ``isend`` and
``irecv``. A new transport replaces it (made by `Call.channel`); the protocol above it sees only
messages. Messages go point-to-point on the gloo group that `tdgather.comm.groups.transport_group`
gives (a side gloo group with the same ranks when the given one is not plain gloo). Receives always
name their source (never any-source), so a dead peer surfaces as an error on its own stream. Tags
are not used: each stream's order is the protocol.

Every call (`tdgather.api.gather`, `tdgather.Collector`) starts with `begin_call`: no other
tdgather call may be open on the group in this process (their streams would mix), and the
call gets the group's next call number. Every prelude carries that number, the call's dst and
a digest of its kind and path, and every receive checks them: a message of another call, from
a rank that skipped one or passed another dst or path, raises `CallMismatchError` naming it.

Rank dst's `Answers` sends every waiting sender a heartbeat (an empty data message) every
``min(timeout / 4, 30 s)`` until it answers, so a sender that finished early waits for as
long as rank dst is alive: the timeout bounds silence, not work.

`DEFAULT_TIMEOUT`, `as_timeout` and `transport_group` are defined in `tdgather.comm.groups`
and importable from here too, where the docs and tests name them.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CallMismatchError, PeerError, PeerLostError, ProtocolError, TdgatherError
from .groups import DEFAULT_TIMEOUT, as_timeout, global_rank, transport_group
from .wire import (
    HEARTBEAT,
    PRELUDE_LEN,
    Kind,
    Limits,
    Prelude,
    check_call,
    decode_header,
    decode_index,
    decode_json,
    encode_json,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "Answers",
    "Call",
    "Channel",
    "Message",
    "as_timeout",
    "begin_call",
    "peer_error",
    "transport_group",
]

_CALLS: dict[int, int] = {}  # per transport group (by id): tdgather calls begun on it
_OPEN: dict[int, int] = {}  # per transport group: the number of the call open on it now
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Call:
    """One tdgather call on a group: what every message of it carries."""

    group: Any
    number: int
    dst: int
    digest: int
    timeout: timedelta
    label: str = ""  # for messages: "gather" or "Collector 'path'"

    def channel(self, peer: int) -> Channel:
        """The stream with ``peer`` for this call."""
        return Channel(self.group, peer, self.timeout, call=(self.number, self.dst, self.digest), label=self.label)

    def end(self) -> None:
        """Release the group for the next call (idempotent)."""
        with _LOCK:
            if _OPEN.get(id(self.group)) == self.number:
                del _OPEN[id(self.group)]


def begin_call(group: Any, kind: str, dst: int, timeout: timedelta, path: str | None = None) -> Call:
    """Start a tdgather call on ``group`` (a transport group), locally; every rank of it must call this.

    Raises:
        CallMismatchError: another tdgather call is open on this group in this process.
    """
    key = id(group)
    with _LOCK:
        if key in _OPEN:
            raise CallMismatchError(
                f"a {kind} was started while another tdgather call (a Collector still open, or a gather() "
                "running in another thread) uses the same process group: their messages would mix. Close the "
                "first one before, or give this one its own group: group=dist.new_group(backend='gloo') "
                "(called on every rank)"
            )
        number = _CALLS.get(key, 0) + 1
        _CALLS[key] = number
        _OPEN[key] = number
    name = f"{kind}\0{path or ''}".encode("utf-8", "surrogatepass")
    label = f"{kind} {path!r}" if path is not None else kind
    return Call(group, number, dst, int.from_bytes(hashlib.sha256(name).digest()[:7], "big"), timeout, label)


class Message:
    """A received message: its prelude, validated header and payload."""

    __slots__ = ("header", "index", "payload", "prelude")

    def __init__(self, prelude: Prelude, header: Any, payload: torch.Tensor | None, index: list | None = None) -> None:
        self.prelude, self.header, self.payload = prelude, header, payload
        self.index = index or []  # a data message's per-group (file_ids, frame_idx, lengths)

    @property
    def kind(self) -> Kind:
        """The message kind."""
        return self.prelude.kind


class Channel:
    """The ordered stream between this rank and one peer, in one direction each way.

    ``send`` posts the prelude, header and payload and returns the pending
    works; ``wait`` blocks on them. ``recv`` reads one whole message, checking
    the prelude before the header is allocated and the header before the payload.
    """

    def __init__(
        self,
        group: Any,
        peer: int,
        timeout: timedelta,
        limits: Limits | None = None,
        call: tuple[int, int, int] = (0, 0, 0),
        label: str = "",
    ) -> None:
        self.group, self.peer, self.timeout = group, peer, timeout
        self.peer_global = global_rank(group, peer)  # the peer's global rank, for messages
        self.limits = limits or Limits()
        self.rank = dist.get_rank(group)
        self.call = call  # (call number, dst, digest of kind and path): in every prelude, checked on receipt
        self.label = label
        self._seq_out = 0
        self._seq_in = 0
        self._send_lock = threading.Lock()  # sends come from several threads; each message is posted whole

    def send(self, kind: Kind, header: dict | None, payload: torch.Tensor | None = None) -> list:
        """Post one message to the peer (a piece has no header); return its pending works (keep them until waited)."""
        raw = b"" if header is None else encode_json(header)
        size = 0 if payload is None else payload.numel()
        with self._send_lock:
            tensors = [Prelude(kind, self._seq_out, len(raw), size, self.rank, *self.call).encode()]
            if raw:
                tensors.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            if size:
                tensors.append(payload)
            self._seq_out += 1
            try:
                return [(t, dist.isend(t, group=self.group, group_dst=self.peer)) for t in tensors]
            except RuntimeError as e:  # gloo refuses to post on a pair it has closed
                raise self._lost(e, "posting a send", self.timeout) from e

    def wait(self, works: list, what: str = "a send") -> None:
        """Wait for posted sends, each for at most the timeout."""
        for _, work in works:
            self._wait(work, what)

    def recv(self, first_wait: timedelta | None = None) -> Message:
        """Receive one message: 1. prelude, 2. header, 3. payload, each validated first.

        A data message's frame index is decoded and checked too (``Message.index``).

        Args:
            first_wait: how long to wait for the prelude (default: the channel's timeout).
                The rest of a message, once started, always comes within the timeout.
        """
        seq = self._seq_in
        prelude = self._recv_prelude(seq, first_wait)
        if prelude.kind == Kind.PIECE:
            raise ProtocolError(self.peer, "prelude.kind", "expected a data, done or error message, got a piece")
        raw_header = torch.empty(prelude.header_len, dtype=torch.uint8)
        self._recv_into(raw_header, f"the header of message {seq}")
        parsed = decode_json(raw_header.numpy().tobytes(), self.peer, self.limits)
        header = decode_header(parsed, prelude.kind, self.peer, prelude.payload_len, self.limits)
        payload = None
        if prelude.payload_len:
            payload = torch.empty(prelude.payload_len, dtype=torch.uint8)
            self._recv_into(payload, f"the payload of message {seq}")
        self._seq_in += 1
        check_call(prelude, self.call, self.label)  # after reading it whole: the stream stays in step
        index = decode_index(header, payload, self.peer) if prelude.kind == Kind.DATA else []
        return Message(prelude, header, payload, index)

    def recv_piece(self, into: torch.Tensor, then: Callable[[], None] | None = None) -> None:
        """Receive the next message, a piece of exactly ``into.numel()`` bytes, into ``into`` (uint8).

        ``then`` runs while the payload is on the wire (the previous piece's scatter).
        """
        seq = self._seq_in
        prelude = self._recv_prelude(seq)
        if prelude.kind != Kind.PIECE or prelude.payload_len != into.numel():
            got = f"a {prelude.kind.name.lower()} message of {prelude.payload_len} bytes"
            raise ProtocolError(self.peer, "prelude.kind", f"expected a piece of {into.numel()} bytes, got {got}")
        what = f"the payload of message {seq}"
        try:
            work = dist.irecv(into, group=self.group, group_src=self.peer)
        except RuntimeError as e:
            raise self._lost(e, what, self.timeout) from e
        if then is not None:
            then()
        self._wait(work, what)
        self._seq_in += 1
        check_call(prelude, self.call, self.label)

    def _recv_prelude(self, seq: int, first_wait: timedelta | None = None) -> Prelude:
        raw_prelude = torch.empty(PRELUDE_LEN, dtype=torch.int64)
        self._recv_into(raw_prelude, f"the prelude of message {seq}", first_wait)
        return Prelude.decode(raw_prelude, self.peer, seq, self.limits)

    def _recv_into(self, tensor: torch.Tensor, what: str, timeout: timedelta | None = None) -> None:
        try:
            work = dist.irecv(tensor, group=self.group, group_src=self.peer)
        except RuntimeError as e:  # gloo refuses to post on a pair it has closed
            raise self._lost(e, what, timeout or self.timeout) from e
        self._wait(work, what, timeout)

    def recv_answer(self) -> Message:
        """Receive rank dst's answer (``done`` or ``error``), past its heartbeats.

        Each wait is bounded by the timeout, and every heartbeat starts a new one: a sender
        waits as long as rank dst is alive, and fails within the timeout once it falls silent.
        """
        while True:
            try:
                msg = self.recv()
            except CallMismatchError as e:  # tell the peer (it refuses this as another call's, naming us)
                with contextlib.suppress(TdgatherError):
                    self.wait(self.send(Kind.ERROR, {"type": type(e).__name__, "message": str(e)}), "the error")
                raise
            if msg.kind != Kind.DATA:
                return msg
            if msg.header.groups:
                raise ProtocolError(self.peer, "header.groups", "expected an answer or a heartbeat, got frames")

    def _wait(self, work: Any, what: str, timeout: timedelta | None = None) -> None:
        timeout = timeout or self.timeout
        try:
            work.wait(timeout)
        except RuntimeError as e:
            raise self._lost(e, what, timeout) from e

    def _lost(self, e: RuntimeError, what: str, timeout: timedelta) -> PeerLostError:
        if "timed out" in str(e).lower():
            cause = (
                f"no progress for {timeout.total_seconds():g} s on {what}; a timed-out gloo pair cannot be reused, "
                "so the rank is treated as lost. If it is only slow, pass a larger timeout=; if it never sent "
                "anything, it may not have entered this call yet, skipped it, or called it with another dst "
                "(every rank must make the same tdgather calls, with the same dst, and enter each within the "
                "timeout of the others)"
            )
        else:
            cause = (
                f"its connection failed during {what} ({e}); the process probably died (or it ended without "
                "making this call: every rank of the group must make it, even with no frames), or it timed out "
                "waiting for another rank (gloo then closes all its connections): check its log"
            )
        return PeerLostError(self.peer, "PeerLost", cause, self.peer_global)


class Answers:
    """Rank dst's side of its answers to every sender: heartbeats until the answer, then the answer.

    1. ``start()``: a thread sends each peer a heartbeat every ``interval`` seconds;
    2. ``answer_all(kind, header)``: the final answer to every peer not yet answered nor lost
       (after it, no heartbeat goes to that peer);
    3. ``stop()``: ends the thread.

    Sends to one peer are posted under one lock, so a heartbeat never follows the answer.
    """

    def __init__(self, channels: dict[int, Channel], interval: float) -> None:
        self.channels = channels
        self.interval = interval
        self.answered: set[int] = set()
        self.lost: set[int] = set()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="tdgather-heartbeat", daemon=True)

    def start(self) -> Answers:
        """Start the heartbeats."""
        self._thread.start()
        return self

    def send_all(self, kind: Kind, header: dict) -> set[int]:
        """A message to every peer still waiting, without ending its wait (``ready``); return the peers lost."""
        lost = set()
        for peer, ch in self.channels.items():
            if peer in self.lost:
                continue
            try:
                self._wait(peer, ch, ch.send(kind, header))
            except PeerLostError:  # posting fails once gloo closed the pairs (after another peer's timeout)
                self.lost.add(peer)
            if peer in self.lost:
                lost.add(peer)
        return lost

    def post(self, peer: int, kind: Kind, header: dict) -> list:
        """Post ``peer`` a message that does not end its wait (a place answer), between heartbeats; the works."""
        with self.lock:
            return self.channels[peer].send(kind, header)

    def answer_all(self, kind: Kind, header: dict | Callable[[int], dict], skip: Collection[int] = ()) -> None:
        """The final answer (one header, or one per peer) to every peer not yet answered, lost or in ``skip``.

        Never raises.
        """
        for peer, ch in self.channels.items():
            with self.lock:
                if peer in self.lost or peer in self.answered or peer in skip:
                    continue
                self.answered.add(peer)
                try:
                    works = ch.send(kind, header(peer) if callable(header) else header)
                except PeerLostError:
                    self.lost.add(peer)
                    continue
            self._wait(peer, ch, works)

    def _wait(self, peer: int, ch: Channel, works: list) -> None:
        try:
            ch.wait(works, "answering the peer")
        except PeerLostError:
            self.lost.add(peer)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            posted = []
            for peer, ch in self.channels.items():
                with self.lock:  # posted under the lock: never after the peer's answer
                    if peer in self.answered or peer in self.lost:
                        continue
                    try:
                        posted.append((peer, ch, ch.send(Kind.DATA, HEARTBEAT)))
                    except PeerLostError:
                        self.lost.add(peer)
            for peer, ch, works in posted:  # gloo completes a send only when it is waited on; a live
                self._wait(peer, ch, works)  # sender always has a receive posted, so this is quick

    def stop(self) -> None:
        """Stop the heartbeats."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def peer_error(ch: Channel, header: dict) -> PeerError:
    """The exception for an ``error`` message from ``ch``'s peer (named by its global rank and group rank)."""
    return PeerError(ch.peer, header["type"], header["message"], ch.peer_global)
