"""A sender on rank dst's host copies each batch once, at ``add``, into the shm file its chunk is sent in.

`tdgather.comm.arena.Arena`: the batches of a chunk's one layout, a single tensor leaf, go back to back
into a kept shm file, where the data message lays out their rows; the send then copies nothing of
them. Wherever a batch does not lie at its offset (another layout first, a small batch before it),
the chunk is copied into another shm file as before, and the arena's goes back to the ring. While
every ring file is held, the arena is a one-shot file, sent once.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tdgather.comm.pack import pack
from tdgather.comm.protocol import Joiner, send_frames
from tdgather.comm.shm import ShmWriter, open_shm
from tdgather.comm.shmfiles import hand_back
from tdgather.core.framestore import FrameStore


class Channel:
    """What `send_frames` needs of a channel: ``send``, here recording each header and each piece's tensor."""

    def __init__(self) -> None:
        self.headers: list[dict] = []
        self.pieces: list[torch.Tensor] = []

    def send(self, kind, header, payload=None) -> list:
        if header is not None:
            self.headers.append(header)
        else:
            self.pieces.append(payload)
        return []


def batch(k: int, rows: int = 8, shape=(3, 32, 32), dtype=torch.float32) -> torch.Tensor:
    return torch.randn((rows, *shape), generator=torch.Generator().manual_seed(k)).to(dtype)


def sent(store: FrameStore, writer: ShmWriter) -> tuple[dict, torch.Tensor]:
    ch = Channel()
    send_frames(ch, pack(store), Joiner(reuse=False), writer, store.arena)
    shm = ch.headers[0]["shm"]
    return shm, open_shm(shm["name"], shm["size"], src=1, keep=shm.get("keep", False))


def test_batches_are_copied_once_into_the_file_their_chunk_is_sent_in(shm):
    writer = ShmWriter()
    store = FrameStore(arena=writer.arena(8 << 20))
    frames = [batch(k) for k in range(4)]
    for k, x in enumerate(frames):
        view = x.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, not contiguous
        assert not view.is_contiguous()
        store.add([f"v{k % 2}.mp4"] * 8, torch.arange(8 * k, 8 * k + 8), view)
    arena = store.arena
    base = arena.kept.mm
    held = [chunk.tensors[0] for _, chunks in store.groups() for chunk in chunks]
    start = torch.frombuffer(base, dtype=torch.uint8).data_ptr()
    assert [t.data_ptr() - start for t in held] == [k * 8 * 3 * 32 * 32 * 4 for k in range(4)]  # back to back
    header, data = sent(store, writer)
    assert header["name"] == arena.kept.path.name and header["keep"]  # the arena's file: nothing copied at send
    rows = data[: 4 * frames[0].nbytes].view(torch.float32).view(32, 3, 32, 32)
    assert torch.equal(rows, torch.cat(frames))  # the rows as the message lays them out, bit for bit
    for x in frames:
        x.zero_()  # the caller reuses its buffers: the copies stand
    assert torch.equal(rows[:8], batch(0))
    writer.cleanup()


@pytest.mark.parametrize("first", ["another layout", "a small batch"])
def test_a_batch_not_where_the_message_puts_it_is_copied_into_another_file(shm, first):
    writer = ShmWriter()
    store = FrameStore(arena=writer.arena(8 << 20))
    if first == "another layout":  # its group comes first in the message
        store.add(["w.mp4"] * 8, torch.arange(8), batch(9, shape=(5,), dtype=torch.float64))
    else:  # copied into the layout's open block, which comes before the batches after it
        store.add(["v0.mp4"], torch.tensor([99]), batch(9, rows=1))
    frames = [batch(k) for k in range(3)]
    for k, x in enumerate(frames):
        store.add(["v0.mp4"] * 8, torch.arange(8 * k, 8 * k + 8), x)
    arena = store.arena
    assert arena.kept is not None  # the batches went into the arena's file...
    header, data = sent(store, writer)
    assert header["name"] != arena.kept.path.name  # ...but the message lays them out elsewhere: another file
    assert not (shm / (arena.kept.path.name + ".free")).exists()
    arena.release()  # as the sender does once the chunk's sends are done
    assert (shm / (arena.kept.path.name + ".free")).exists()  # the arena's file goes back to the ring
    wanted = torch.cat([c.tensors[0].reshape(-1).view(torch.uint8) for _, cs in store.groups() for c in cs])
    assert torch.equal(data[data.numel() - 3 * frames[0].nbytes :], torch.cat(frames).reshape(-1).view(torch.uint8))
    assert wanted.numel() <= data.numel()
    writer.cleanup()


def test_batches_past_the_arena_or_of_a_second_layout_are_kept_as_before(shm):
    writer = ShmWriter()
    store = FrameStore(arena=writer.arena(2 * batch(0).nbytes))
    for k in range(3):  # the third does not fit: it, and every batch after it, is a copy of its own
        store.add(["v.mp4"] * 8, torch.arange(8 * k, 8 * k + 8), batch(k))
    store.add(["w.mp4"] * 8, torch.arange(8), batch(7, shape=(5,)))
    arena = store.arena
    start = torch.frombuffer(arena.kept.mm, dtype=torch.uint8).data_ptr()
    inside = [start <= c.tensors[0].data_ptr() < start + arena.kept.size for _, cs in store.groups() for c in cs]
    assert inside == [True, True, False, False]
    header, data = sent(store, writer)  # the message is larger than the arena's file: all of it in another
    assert header["name"] != arena.kept.path.name
    n = batch(0).nbytes
    got = data[: 3 * n].view(torch.float32).view(24, 3, 32, 32)
    assert torch.equal(got, torch.cat([batch(0), batch(1), batch(2)]))
    writer.cleanup()


def test_with_every_ring_file_held_batches_go_once_into_a_file_sent_once(shm):
    writer = ShmWriter(ring=0)  # no ring file free: a one-shot file, not a copy into memory of its own first
    store = FrameStore(arena=writer.arena(8 << 20))
    store.add(["v.mp4"] * 8, torch.arange(8), batch(0))
    one_shot = store.arena.kept
    assert one_shot is not None and not one_shot.ring
    assert one_shot.allocated < one_shot.size  # pages allocated as the batches come, not the whole arena
    header, data = sent(store, writer)
    assert header["name"] == one_shot.path.name and not header.get("keep")  # rank dst unlinks it as it maps it
    assert header["size"] < one_shot.size and not one_shot.path.exists()
    assert torch.equal(data[: batch(0).nbytes].view(torch.float32).view(8, 3, 32, 32), batch(0))
    store.arena.release()
    writer.cleanup()
    assert list(shm.iterdir()) == []


def test_a_one_shot_file_its_chunk_was_not_sent_in_is_removed(shm):
    writer = ShmWriter(ring=0)
    store = FrameStore(arena=writer.arena(8 << 20))
    store.add(["w.mp4"] * 8, torch.arange(8), batch(9, shape=(5,), dtype=torch.float64))  # not in place
    store.add(["v.mp4"] * 8, torch.arange(8), batch(0))
    one_shot = store.arena.kept
    header, data = sent(store, writer)
    assert header["name"] != one_shot.path.name and one_shot.path.exists()
    store.arena.release()  # the sends are done: the file the chunk was not sent in goes
    assert not one_shot.path.exists()
    assert torch.equal(data[data.numel() - batch(0).nbytes :].view(torch.float32).view(8, 3, 32, 32), batch(0))
    writer.cleanup()
    assert list(shm.iterdir()) == []


def test_without_room_for_an_arena_batches_are_kept_as_before(shm, monkeypatch):
    writer = ShmWriter()
    monkeypatch.setenv("TDGATHER_SHM_SPARE", str(1 << 62))  # no room for an shm file: no arena, and gloo
    store = FrameStore(arena=writer.arena(8 << 20))
    store.add(["v.mp4"] * 8, torch.arange(8), batch(0))
    assert store.arena.kept is None
    ch = Channel()
    send_frames(ch, pack(store), Joiner(reuse=False), writer, store.arena)
    assert "shm" not in ch.headers[0]
    wanted = batch(0).reshape(-1).view(torch.uint8)
    assert any(p.numel() == wanted.numel() and torch.equal(p, wanted) for p in ch.pieces)
    writer.cleanup()


def test_a_chunk_sent_over_gloo_from_its_arena_keeps_the_file_until_the_sends_are_done(shm, monkeypatch):
    writer = ShmWriter(ring=1)
    store = FrameStore(arena=writer.arena(8 << 20))
    store.add(["w.mp4"] * 8, torch.arange(8), batch(9, shape=(5,), dtype=torch.float64))  # not in place
    store.add(["v.mp4"] * 8, torch.arange(8), batch(0))
    arena = store.arena
    monkeypatch.setenv("TDGATHER_SHM_SPARE", str(1 << 62))  # no room for another shm file: gloo carries it
    ch = Channel()
    send_frames(ch, pack(store), Joiner(reuse=False), writer, arena)
    assert "shm" not in ch.headers[0]
    in_flight = [p for p in ch.pieces if p.numel() == batch(0).nbytes]
    assert len(in_flight) == 1  # the batch goes from the arena's file, as it lies there: no copy
    monkeypatch.delenv("TDGATHER_SHM_SPARE")
    held = writer.arena(8 << 20)
    assert held.take(object(), 64) is not None and not held.kept.ring  # the file is not the next chunk's in flight
    held.release()
    assert torch.equal(in_flight[0].view(torch.float32).view(8, 3, 32, 32), batch(0))
    arena.release()  # the sends are done
    nxt = writer.arena(8 << 20)
    assert nxt.take(object(), 64) is not None and nxt.kept.path == arena.kept.path  # now it is
    writer.cleanup()


def test_a_batch_allocates_the_pages_it_is_written_into_and_a_ring_file_reuses_its_own(shm):
    """Past the pages allocated, a batch is written into the file (the kernel allocates each page as
    it copies), none ahead of it; on a ring file's next lap, into the pages it has, then past them."""
    writer = ShmWriter(ring=1)
    store = FrameStore(arena=writer.arena(8 << 20))
    small = batch(0, rows=6)  # 72 KiB (a batch of 64 KiB or less is copied into a block of small ones)
    store.add(["v.mp4"] * 6, torch.arange(6), small)
    kept = store.arena.kept
    assert kept.allocated == small.nbytes and os.fstat(kept.fd).st_blocks * 512 == small.nbytes
    header, data = sent(store, writer)
    assert header["name"] == kept.path.name and header["keep"]
    assert torch.equal(data[: small.nbytes].view(torch.float32).view(small.shape), small)
    hand_back(kept.path)  # rank dst is done with it
    again = FrameStore(arena=writer.arena(8 << 20))
    big = batch(1, rows=12)  # 144 KiB: its first 72 KiB into the pages there, the rest past them
    again.add(["w.mp4"] * 12, torch.arange(12), big)
    assert again.arena.kept is kept and kept.allocated == big.nbytes
    header, data = sent(again, writer)
    assert header["name"] == kept.path.name
    assert torch.equal(data[: big.nbytes].view(torch.float32).view(big.shape), big)
    writer.cleanup()


def test_a_batch_with_no_room_left_for_its_pages_is_kept_as_before(shm, monkeypatch):
    writer = ShmWriter()
    store = FrameStore(arena=writer.arena(8 << 20))
    store.add(["v.mp4"] * 8, torch.arange(8), batch(0))
    monkeypatch.setenv("TDGATHER_SHM_SPARE", str(1 << 62))  # the directory fills up: no page for the next batch
    store.add(["v.mp4"] * 8, torch.arange(8, 16), batch(1))
    arena = store.arena
    assert arena.closed and arena.kept.allocated == batch(0).nbytes
    start = torch.frombuffer(arena.kept.mm, dtype=torch.uint8).data_ptr()
    held = [c.tensors[0] for _, cs in store.groups() for c in cs]
    assert [start <= t.data_ptr() < start + arena.kept.size for t in held] == [True, False]
    ch = Channel()
    send_frames(ch, pack(store), Joiner(reuse=False), writer, arena)  # no room for a copy either: gloo
    assert "shm" not in ch.headers[0]
    wanted = torch.cat([batch(0), batch(1)]).reshape(-1).view(torch.uint8)  # the two joined into one piece
    assert [p.numel() for p in ch.pieces] == [wanted.numel()] and torch.equal(ch.pieces[0], wanted)
    arena.release()
    writer.cleanup()


def test_a_one_shot_file_never_sent_is_closed_and_removed_at_cleanup(shm):
    """A run that fails before the chunk is sent: the sender's cleanup lets go of the file's memory too."""
    writer = ShmWriter(ring=0)
    store = FrameStore(arena=writer.arena(8 << 20))
    store.add(["v.mp4"] * 8, torch.arange(8), batch(0))
    path = str(store.arena.kept.path)
    assert path in open_files()
    writer.cleanup()  # no send, no release
    assert list(shm.iterdir()) == []
    del store  # the batches' views of its mapping go (the mapping holds a descriptor of its own until then)
    gc.collect()
    assert not any(path in f for f in open_files())  # a descriptor held open would keep its pages until exit


def open_files() -> list[str]:
    """What this process's descriptors point at (Linux: ``/proc/self/fd``)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir used, closed since
            pass
    return out


GPU = torch.device("cuda", 0)  # only named: the double page-locks nothing


class Pin:
    """A double of `tdgather.comm.pinning.register`: records each mapping's size it page-locks, and each undo."""

    def __init__(self, works: bool = True) -> None:
        self.works, self.sizes, self.unpinned = works, [], 0

    def __call__(self, mm, device):
        self.sizes.append(len(mm))
        return self.unpin if self.works else None

    def unpin(self) -> None:
        self.unpinned += 1


def test_a_gpu_batch_page_locks_its_ring_file_once_and_cleanup_undoes_it(shm):
    pin = Pin()
    writer = ShmWriter(pin=pin)
    arena = writer.arena(8 << 20)
    first, second = arena.take("layout", 1 << 20, device=GPU), arena.take("layout", 1 << 20, device=GPU)
    assert second.data_ptr() == first.data_ptr() + (1 << 20)  # back to back, as a CPU batch's
    assert pin.sizes == [8 << 20] and arena.kept.allocated == 8 << 20  # the whole file, its pages allocated first
    arena.release()  # not sent: back to the ring, still page-locked
    again = writer.arena(8 << 20)
    assert again.take("layout", 1 << 20, device=GPU) is not None and again.kept is arena.kept
    assert pin.sizes == [8 << 20] and pin.unpinned == 0  # the ring file is locked once, not per chunk
    again.release()
    writer.cleanup()
    assert pin.unpinned == 1 and list(shm.iterdir()) == []


def test_where_page_locking_fails_gpu_batches_are_kept_as_before_and_it_is_not_tried_again(shm):
    pin = Pin(works=False)
    writer = ShmWriter(pin=pin)
    arena = writer.arena(8 << 20)
    assert arena.take("layout", 1 << 20, device=GPU) is None and arena.closed
    assert arena.take("layout", 1 << 20) is None  # from the first batch it cannot take, it takes none
    arena.release()
    later = writer.arena(8 << 20)
    assert later.take("layout", 1 << 20, device=GPU) is None
    assert pin.sizes == [8 << 20]  # one try for the writer
    cpu = writer.arena(8 << 20)
    assert cpu.take("layout", 1 << 20) is not None  # CPU batches still go into the ring
    cpu.release()
    writer.cleanup()
    assert pin.unpinned == 0


def test_a_one_shot_file_is_not_page_locked(shm):
    pin = Pin()
    writer = ShmWriter(ring=0, pin=pin)  # every ring file held: the arena's file is sent once
    arena = writer.arena(8 << 20)
    assert arena.take("layout", 1 << 20, device=GPU) is None
    assert pin.sizes == [] and arena.kept is not None and not arena.kept.ring
    arena.release()
    writer.cleanup()
    assert list(shm.iterdir()) == []
