"""The message sequence on a recording fake process group, and gloo group selection."""

from collections import deque
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import tdgather
from tdgather.api.send import send
from tdgather.comm import transport
from tdgather.comm.protocol import expect_done, read_frames
from tdgather.comm.transport import Channel
from tdgather.comm.wire import MAGIC, VERSION, Kind, Prelude, encode_json
from tdgather.errors import PeerError


class FakeWire:
    """Records isend tensors and serves irecv from per-peer queues."""

    class Work:
        def wait(self, timeout=None):
            return True

    class Closed:
        def wait(self, timeout=None):
            raise RuntimeError("[pair.cc:553] Connection closed by peer")

    def __init__(self, rank):
        self.rank = rank
        self.sent: list[tuple[int, torch.Tensor]] = []
        self.inbox: dict[int, deque] = {}

    def isend(self, t, group=None, group_dst=None):
        self.sent.append((group_dst, t.clone()))
        return self.Work()

    def irecv(self, t, group=None, group_src=None):
        if not self.inbox.get(group_src):
            return self.Closed()
        data = self.inbox[group_src].popleft()
        assert data.dtype == t.dtype and data.shape == t.shape, "receive posted with the wrong size"
        t.copy_(data)
        return self.Work()


@pytest.fixture
def wire(monkeypatch):
    fake = FakeWire(rank=1)
    monkeypatch.setattr(dist, "isend", fake.isend)
    monkeypatch.setattr(dist, "irecv", fake.irecv)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: fake.rank)
    return fake


def answer(kind, header, src=0, seq=0):
    raw = encode_json(header)
    return [Prelude(kind, seq, len(raw), 0, src).encode(), torch.frombuffer(bytearray(raw), dtype=torch.uint8)]


def after_ready(kind, header):
    """Rank dst's ready answer (no host: gloo carries everything), then its answer."""
    return deque(answer(Kind.DONE, {"frames": 0}) + answer(kind, header, seq=1))


def test_sender_sequence_and_receiver_replay(wire):
    preds = {"a.mp4": [(1, torch.ones(2, 2)), (0, torch.zeros(2, 2))], "b.mp4": (4, torch.full((2, 2), 3.0))}
    wire.inbox[0] = after_ready(Kind.DONE, {"frames": 3})
    send(preds, Channel(None, 0, timedelta(seconds=5)))
    dsts, tensors = zip(*wire.sent, strict=True)
    assert set(dsts) == {0}
    # 1. data prelude, 2. header, 3. frame index, 4. piece prelude, 5. piece, 6. done prelude, 7. done header
    assert len(tensors) == 7
    p0, p3, p5 = tensors[0].tolist(), tensors[3].tolist(), tensors[5].tolist()
    assert p0[:4] == [MAGIC, VERSION, Kind.DATA, 0] and p0[4] == tensors[1].numel() and p0[5] == tensors[2].numel()
    assert p3[:6] == [MAGIC, VERSION, Kind.PIECE, 1, 0, 48] and tensors[4].numel() == 48  # 3 frames of 16 bytes
    assert p5[:4] == [MAGIC, VERSION, Kind.DONE, 2] and p5[5] == 0 and p5[6] == 1
    assert bytes(tensors[6].tolist()) == b'{"frames":3}'
    # replay the stream into rank 0's receiver
    wire.rank = 0
    wire.inbox[1] = deque(tensors)
    ch = Channel(None, 1, timedelta(seconds=5))
    parts = read_frames(ch, ch.recv())
    expect_done(ch, ch.recv(), 3)
    assert [p.files for p in parts] == [["a.mp4", "b.mp4"]] and parts[0].rank == 1
    assert parts[0].frame_idx.tolist() == [1, 0, 4] and parts[0].file_ids.tolist() == [0, 0, 1]  # the sender's order
    assert torch.equal(
        parts[0].chunks[0][0], torch.stack([torch.ones(2, 2), torch.zeros(2, 2), torch.full((2, 2), 3.0)])
    )


def test_empty_sender_sends_an_empty_data_message_then_done(wire):
    wire.inbox[0] = after_ready(Kind.DONE, {"frames": 0})
    send({}, Channel(None, 0, timedelta(seconds=5)))
    assert [t.tolist()[2] for _, t in wire.sent[::2]] == [Kind.DATA, Kind.DONE]
    assert bytes(wire.sent[1][1].tolist()) == b'{"files":[],"groups":[]}'


def test_sender_raises_when_destination_answers_error(wire):
    wire.inbox[0] = after_ready(Kind.ERROR, {"type": "DuplicateFrameError", "message": "filename 'x' ..."})
    with pytest.raises(PeerError, match="rank 0 failed with DuplicateFrameError: filename 'x'"):
        send({"x": (0, torch.ones(1))}, Channel(None, 0, timedelta(seconds=5)))


def test_bad_input_sends_error_message(wire):
    wire.inbox[0] = after_ready(Kind.ERROR, {"type": "PeerError", "message": "rank 1 failed"})
    with pytest.raises(tdgather.UnsupportedValueError, match="complex128"):
        send({"x": (0, torch.ones(1, dtype=torch.complex128))}, Channel(None, 0, timedelta(seconds=5)))
    kinds = [t.tolist()[2] for _, t in wire.sent[::2]]
    assert kinds == [Kind.ERROR]
    assert b"UnsupportedValueError" in bytes(wire.sent[1][1].tolist())


def test_side_gloo_group_is_made_once_for_nccl(monkeypatch):
    made = []
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: [0, 1, 2, 9])  # ranks no other group has
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend, **kw: made.append((tuple(ranks), backend)) or "side")
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda g, b=backend: b)
        assert transport.transport_group("user-group") == "side"
    assert made == [((0, 1, 2, 9), "gloo")]
    monkeypatch.setattr(dist, "get_backend", lambda g: "gloo")
    assert transport.transport_group("user-group") == "user-group"


def test_timeouts():
    assert transport.as_timeout(None) == transport.DEFAULT_TIMEOUT
    assert transport.as_timeout(2.5) == timedelta(seconds=2.5)
    with pytest.raises(ValueError, match="expected a positive, finite number of seconds .*got 0"):
        transport.as_timeout(0)


def test_bad_input_still_raises_when_destination_is_lost(wire):
    with pytest.raises(tdgather.UnsupportedValueError, match="complex128"):
        send({"x": (0, torch.ones(1, dtype=torch.complex128))}, Channel(None, 0, timedelta(seconds=5)))


def test_lost_destination_is_reported(wire):
    with pytest.raises(tdgather.PeerLostError, match="rank 0 failed with PeerLost: its connection failed"):
        send({"x": (0, torch.ones(1))}, Channel(None, 0, timedelta(seconds=5)))
