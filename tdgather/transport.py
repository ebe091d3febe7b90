"""Stage 3, transport: one ordered message stream per peer, over gloo.

Messages go point-to-point with ``isend``/``irecv`` on a gloo group. When the
given group is not plain gloo (NCCL, or ``cpu:gloo,cuda:nccl``), a side gloo
group with the same ranks is made once and reused. Receives always name their
source (never any-source), so a dead peer surfaces as an error on its own
stream. Tags are not used: each stream's order is the protocol.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import PeerLostError, ProtocolError
from .wire import PRELUDE_LEN, Kind, Limits, Prelude, decode_header, decode_json, encode_json

__all__ = ["DEFAULT_TIMEOUT", "Channel", "Message", "as_timeout", "needs_side_group", "transport_group"]

DEFAULT_TIMEOUT = timedelta(minutes=30)
_SIDE_GROUPS: dict[tuple[int, ...], Any] = {}


def as_timeout(timeout: float | timedelta | None) -> timedelta:
    """Normalise a timeout given in seconds or as a timedelta (None: the default)."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    value = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    return value


def needs_side_group(backend: str) -> bool:
    """Whether a process group with this backend string needs a side gloo group.

    >>> needs_side_group("gloo"), needs_side_group("nccl"), needs_side_group("cpu:gloo,cuda:nccl")
    (False, True, True)
    """
    return str(backend).lower() != "gloo"


def transport_group(group: Any = None) -> Any:
    """Return the gloo group tdgather sends on for ``group`` (default: the world).

    Every member of ``group`` must call this, in the same order, the first time
    (``dist.new_group`` is collective over the members). Later calls are free.
    """
    group = group if group is not None else dist.group.WORLD
    if not needs_side_group(dist.get_backend(group)):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _SIDE_GROUPS:
        _SIDE_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _SIDE_GROUPS[ranks]


class Message:
    """A received message: its prelude, validated header and payload."""

    __slots__ = ("header", "payload", "prelude")

    def __init__(self, prelude: Prelude, header: Any, payload: torch.Tensor | None) -> None:
        self.prelude, self.header, self.payload = prelude, header, payload

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

    def __init__(self, group: Any, peer: int, timeout: timedelta, limits: Limits | None = None) -> None:
        self.group, self.peer, self.timeout = group, peer, timeout
        self.limits = limits or Limits()
        self.rank = dist.get_rank(group)
        self._seq_out = 0
        self._seq_in = 0

    def send(self, kind: Kind, header: dict, payload: torch.Tensor | None = None) -> list:
        """Post one message to the peer; return its pending works (keep them until waited)."""
        raw = encode_json(header)
        size = 0 if payload is None else payload.numel()
        tensors = [
            Prelude(kind, self._seq_out, len(raw), size, self.rank).encode(),
            torch.frombuffer(bytearray(raw), dtype=torch.uint8),
        ]
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

        Args:
            first_wait: how long to wait for the prelude (default: the channel's timeout).
                The rest of a message, once started, always comes within the timeout.
        """
        seq = self._seq_in
        raw_prelude = torch.empty(PRELUDE_LEN, dtype=torch.int64)
        work = dist.irecv(raw_prelude, group=self.group, group_src=self.peer)
        self._wait(work, f"the prelude of message {seq}", first_wait)
        prelude = Prelude.decode(raw_prelude, self.peer, seq, self.limits)
        if prelude.header_len == 0:
            raise ProtocolError(self.peer, "prelude.header_len", "expected a header, got length 0")
        raw_header = torch.empty(prelude.header_len, dtype=torch.uint8)
        self._wait(dist.irecv(raw_header, group=self.group, group_src=self.peer), f"the header of message {seq}")
        parsed = decode_json(raw_header.numpy().tobytes(), self.peer, self.limits)
        header = decode_header(parsed, prelude.kind, self.peer, prelude.payload_len)
        payload = None
        if prelude.payload_len:
            payload = torch.empty(prelude.payload_len, dtype=torch.uint8)
            self._wait(dist.irecv(payload, group=self.group, group_src=self.peer), f"the payload of message {seq}")
        self._seq_in += 1
        return Message(prelude, header, payload)

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
                "so the rank is treated as lost. If it is only slow, pass a larger timeout="
            )
        else:
            cause = (
                f"its connection failed during {what} ({e}); the process probably died, or it timed out "
                "waiting for another rank (gloo then closes all its connections): check its log"
            )
        return PeerLostError(self.peer, "PeerLost", cause)
