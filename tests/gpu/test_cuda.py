"""GPU-resident predictions: one pinned host copy on the sender, nothing on a GPU at rank 0.

Skipped without CUDA. Two gloo ranks share one GPU when the machine has only one.
"""

import math
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

import tdgather
from tdgather.comm.pack import pack
from tdgather.comm.protocol import Joiner, send_frames
from tdgather.comm.shm import ShmWriter, open_shm
from tdgather.core.framestore import FrameStore
from tdgather.tools.launch import run_local_world

from ..test_arena import Channel

pytestmark = [
    pytest.mark.world,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FRAME = (3, 64, 64)
BATCHES, BATCH = 6, 16  # per rank
WORLD = 2


def _device() -> torch.device:
    return torch.device("cuda", dist.get_rank() % torch.cuda.device_count() if dist.is_initialized() else 0)


def _cuda_batches(rank: int, n: int = BATCHES, batch: int = BATCH):
    """Batches made on the GPU, as a model's outputs would be."""
    g = torch.Generator(device=_device()).manual_seed(rank)
    for b in range(n):
        names = [f"r{rank}_v{(b * batch + k) // 40}.mp4" for k in range(batch)]
        idx = torch.arange(b * batch, (b + 1) * batch, device=_device()) % 40
        yield names, idx, torch.randn((batch, *FRAME), generator=g, device=_device())


def test_store_copies_cuda_frames_once_into_pinned_host_memory():
    store = tdgather.FrameStore()
    names, idx, frames = next(_cuda_batches(0))
    store.add(names, idx, {"depth": frames, "mask": frames > 0})
    [(_, [chunk])] = store.groups()
    assert all(t.device.type == "cpu" and t.is_pinned() for t in chunk.tensors)
    result = tdgather.gather(store)
    got = torch.cat([result[n].frames["depth"] for n in sorted(set(names))])
    assert torch.equal(got, frames.cpu())


def case_gather_from_gpus(streaming: bool, out: str) -> dict | None:
    rank = dist.get_rank()
    torch.cuda.set_device(_device())
    batches = list(_cuda_batches(rank))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    if streaming:
        with tdgather.Collector(out, timeout=120, progress=False) as col:
            for names, idx, frames in batches:
                col.add(names, idx, frames)
        result = tdgather.open(out) if rank == 0 else None
    else:
        store = tdgather.FrameStore()
        for names, idx, frames in batches:
            store.add(names, idx, frames)
        result = tdgather.gather(store, timeout=120)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    if rank != 0:
        return None
    expected = {}
    for r in range(dist.get_world_size()):
        for names, idx, frames in _cuda_batches(r):
            for name, i, frame in zip(names, idx.tolist(), frames.cpu(), strict=True):
                expected.setdefault(name, {})[i] = frame
    assert sorted(result) == sorted(expected)
    for name, by_idx in expected.items():
        f = result[name]
        assert f.frames.device.type == "cpu"
        assert torch.equal(f.frames, torch.stack([by_idx[i] for i in sorted(by_idx)])), name
    received = sum(f.frames.numel() * f.frames.element_size() for f in (result[n] for n in result))
    return {"before": before, "after": after, "received": received}


@pytest.mark.parametrize("streaming", [False, True], ids=["gather", "collector"])
def test_rank0_allocates_no_gpu_memory_for_gathered_frames(tmp_path, streaming):
    out = run_local_world(case_gather_from_gpus, WORLD, streaming, str(tmp_path / "ds"), timeout=300)[0]
    sent = WORLD * BATCHES * BATCH * math.prod(FRAME) * torch.float32.itemsize  # 9,437,184 bytes: every frame
    assert out["received"] == sent  # rank 0 holds every rank's frames on the host (frame_idx are unique per rank)
    assert out["after"] == out["before"], f"rank 0's GPU memory grew by {out['after'] - out['before']} bytes"


def _detections(rank: int, batches: int = 3, batch: int = 8) -> list:
    """Per-image dicts (torchvision's detection output), 0-5 boxes each, made on the CPU from a seed."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for b in range(batches):
        images = [
            {"boxes": torch.rand(int(n), 4, generator=g), "labels": torch.randint(0, 80, (int(n),), generator=g)}
            for n in torch.randint(0, 6, (batch,), generator=g)
        ]
        out.append(([f"r{rank}_det.mp4"] * batch, torch.arange(b * batch, (b + 1) * batch), images))
    return out


def case_ragged_from_gpus() -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(_device())
    store = tdgather.FrameStore()
    for names, idx, images in _detections(rank):
        on_gpu = [{k: v.to(_device()) for k, v in image.items()} for image in images]
        store.add(names, idx.to(_device()), on_gpu, ragged=["boxes", "labels"])
    [(_, chunks)] = store.groups()
    pinned = all(t.values.is_pinned() for c in chunks for t in c.tensors)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    result = tdgather.gather(store, timeout=120)
    torch.cuda.synchronize()
    grew = torch.cuda.memory_allocated() - before
    if rank != 0:
        return None
    frames = wrong = 0
    for r in range(world):
        f = result[f"r{r}_det.mp4"]
        images = [image for _, _, batch in _detections(r) for image in batch]
        frames += f.frame_idx.numel()
        for i, image in enumerate(images):
            got = {k: f.frames[k][i] for k in image}
            wrong += not all(got[k].device.type == "cpu" and torch.equal(got[k], v) for k, v in image.items())
    return {"frames": frames, "wrong": wrong, "grew": grew, "pinned": pinned}


def test_ragged_detections_on_gpus_reach_rank0_on_the_host():
    out = run_local_world(case_ragged_from_gpus, WORLD, timeout=300)[0]
    assert out == {"frames": WORLD * 3 * 8, "wrong": 0, "grew": 0, "pinned": True}


@pytest.fixture
def tmpfs_shm(monkeypatch):
    """A segment directory of the test's own in /dev/shm: page-locking needs memory pages, not a disk file's."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs /dev/shm")
    where = tempfile.mkdtemp(prefix="tdgather-test-", dir="/dev/shm")
    monkeypatch.setenv("TDGATHER_SHM_DIR", where)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def test_a_same_host_senders_cuda_batches_are_copied_by_the_gpu_into_the_shm_file_they_are_sent_in(tmpfs_shm):
    """A Collector's sender on rank dst's host: one device-to-host copy per byte, into its ring file, page-locked."""
    writer = ShmWriter()
    store = FrameStore(arena=writer.arena(8 << 20))
    batches = list(_cuda_batches(0, n=3))
    for k, (names, idx, frames) in enumerate(batches):
        store.add(names, idx, frames if k != 1 else frames.transpose(2, 3).contiguous().transpose(2, 3))
    arena = store.arena
    start = torch.frombuffer(arena.kept.mm, dtype=torch.uint8).data_ptr()
    held = [chunk.tensors[0] for _, chunks in store.groups() for chunk in chunks]
    nbytes = batches[0][2].nbytes
    assert [t.data_ptr() - start for t in held] == [k * nbytes for k in range(3)]  # back to back in the file
    assert all(t.is_pinned() for t in held)  # the file's mapping is page-locked: the GPU copies into it
    ch = Channel()
    send_frames(ch, pack(store), Joiner(reuse=False), writer, arena)
    [header] = [h["shm"] for h in ch.headers if "shm" in h]
    assert header["name"] == arena.kept.path.name  # sent in the file the GPU copied into: nothing copied at send
    data = open_shm(header["name"], header["size"], src=1, keep=True)
    rows = data[: 3 * nbytes].view(torch.float32).view(3 * BATCH, *FRAME)
    assert torch.equal(rows, torch.cat([frames for _, _, frames in batches]).cpu())
    del data, rows, held
    arena.release()
    writer.cleanup()
    assert os.listdir(tmpfs_shm) == []
