"""GPU-resident predictions: one pinned host copy on the sender, nothing on a GPU at rank 0.

Skipped without CUDA. Two gloo ranks share one GPU when the machine has only one.
"""

import pytest
import torch
import torch.distributed as dist

import tdgather
from tdgather.launch import run_local_world

pytestmark = [
    pytest.mark.world,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FRAME = (3, 64, 64)


def _device() -> torch.device:
    return torch.device("cuda", dist.get_rank() % torch.cuda.device_count() if dist.is_initialized() else 0)


def _cuda_batches(rank: int, n: int = 6, batch: int = 16):
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
    chunk = next(iter(store._chunks.values()))[0]
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
    received = sum(f.frames.numel() * 4 for f in (result[n] for n in result))
    return {"before": before, "after": after, "received": received}


@pytest.mark.parametrize("streaming", [False, True], ids=["gather", "collector"])
def test_rank0_allocates_no_gpu_memory_for_gathered_frames(tmp_path, streaming):
    out = run_local_world(case_gather_from_gpus, 2, streaming, str(tmp_path / "ds"), timeout=300)[0]
    assert out["received"] > 10_000_000
    assert out["after"] == out["before"], f"rank 0's GPU memory grew by {out['after'] - out['before']} bytes"
