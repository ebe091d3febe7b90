"""Prediction generators, a pickle-based reference, and the per-rank world cases.

The functions named ``case_*`` run inside every rank of a local gloo world
(`tdgather.tools.launch.run_local_world`); they compare `tdgather.gather` with what
`torch.distributed.gather_object` gives for the same inputs, and assert on rank 0.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from tensordict import NonTensorStack, TensorDict, is_non_tensor, is_tensorclass, tensorclass
from tensordict.base import TensorDictBase

import tdgather
from tdgather.storage.writer import DatasetWriter


@tensorclass
class DepthMask:
    depth_map: torch.Tensor
    mask: torch.Tensor


MIXED = {
    "bf16.mp4": (torch.bfloat16, (2, 3)),
    "u8.mp4": (torch.uint8, (4,)),
    "f8.mp4": (torch.float8_e4m3fn, (3,)),
    "f8b.mp4": (torch.float8_e5m2, (2, 2)),
    "bool.mp4": (torch.bool, (5,)),
    "f64.mp4": (torch.float64, ()),
    "i16.mp4": (torch.int16, (0, 3)),
    "f16.mp4": (torch.float16, (1,)),
    "i64.mp4": (torch.int64, (2,)),
}


def value(name: str, idx: int, shape=(3,), dtype=torch.float32) -> torch.Tensor:
    """A deterministic frame for (name, idx): equal on every rank that makes it."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{idx}".encode()))
    x = torch.randn(shape, generator=g) * 50
    if dtype == torch.bool:
        return x > 0
    if not dtype.is_floating_point:
        return x.abs().to(torch.int64).to(dtype)
    return x.to(dtype)


def predictions(scenario: str, rank: int, world: int) -> dict:
    """The ``{filename: ...}`` dict rank ``rank`` holds in a scenario."""
    p: dict = {}
    if scenario == "uneven":
        for i in range(7):
            n = (i * 5 + rank * 3) % 6 if i % world == rank else 0
            if n:
                p[f"clip_{i:04d}.mp4"] = [(j, value(f"clip_{i:04d}.mp4", j)) for j in reversed(range(n))]
        p[f"single_{rank}.jpg"] = (rank, value(f"single_{rank}.jpg", rank, (2, 2)))
    elif scenario == "zero_rank":
        if rank != 1:
            p = {f"v{rank}_{i}": [(j, value(f"v{rank}_{i}", j)) for j in range(rank + i + 1)] for i in range(3)}
    elif scenario == "all_empty":
        pass
    elif scenario == "split":  # DistributedSampler-style striding of one long video
        p["long.mp4"] = [(j, value("long.mp4", j, (4, 4))) for j in range(rank, 40, world)][::-1]
        p[f"own_{rank}.mp4"] = (0, value(f"own_{rank}.mp4", 0, (4, 4)))
    elif scenario == "dup_identical":  # the last rank repeats the first frames, as sampler padding does
        p["pad.mp4"] = [(j, value("pad.mp4", j)) for j in range(rank, 10, world)]
        if rank == world - 1:
            p["pad.mp4"] += [(j, value("pad.mp4", j)) for j in (0, 1)]
    elif scenario == "mixed":
        for k, (name, (dt, shape)) in enumerate(MIXED.items()):
            if k % world == rank:
                p[name] = [(j, value(name, j, shape, dt)) for j in range(3)]
        t = value("strided.mp4", rank, (3, 5)).t()  # non-contiguous
        p["strided.mp4"] = (rank, t)
    elif scenario == "nested":
        p["nest.mp4"] = [
            (j, {"depth": value("d", j, (1, 2, 2)), "extra": {"score": value("s", j, ())}, "label": f"l{j}", "n": j})
            for j in range(rank, 9, world)
        ]
        p[f"tc_{rank % 2}.mp4"] = [
            (
                j + 10 * rank,
                DepthMask(depth_map=value("tc", j, (2,)), mask=value("m", j, (2,), torch.bool), batch_size=[]),
            )
            for j in range(2)
        ]
    elif scenario == "dup_conflict":
        p["x.mp4"] = [(j, value("x.mp4", j)) for j in range(3)]
        if rank == 1:
            p["x.mp4"][1] = (1, value("x.mp4", 1) + 1)
    elif scenario == "shape_mismatch":
        p["x.mp4"] = [(rank, value("x.mp4", rank, (3,) if rank == 0 else (3, 4)))]  # a dim more: no fit
        p["ok.mp4"] = (rank, value("ok.mp4", rank))
    elif scenario == "unsupported":
        p["x.mp4"] = (0, torch.zeros(2, dtype=torch.complex128) if rank == 1 else torch.zeros(2))
    else:
        raise ValueError(scenario)
    return p


def _pairs(entry):
    return [entry] if isinstance(entry, tuple) and not isinstance(entry[0], tuple) else list(entry)


def reference(per_rank: list[dict]) -> dict[str, list]:
    """What the result must be, from `gather_object` output: sorted, identical duplicates once."""
    out: dict[str, dict[int, object]] = {}
    for p in per_rank:
        for name, entry in p.items():
            for idx, v in _pairs(entry):
                out.setdefault(name, {}).setdefault(int(idx), v)
    return {name: sorted(d.items()) for name, d in sorted(out.items())}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _unwrap(v):
    if is_non_tensor(v):
        return v.tolist() if isinstance(v, NonTensorStack) else v.data
    return v


def assert_same_value(got, want, where: str) -> None:
    """Bit-exact equality of tensors, TensorDicts, tensorclasses, dicts and JSON values."""
    if is_tensorclass(want):
        assert type(got) is type(want), f"{where}: {type(got)} is not {type(want)}"
        got, want = got._tensordict, want._tensordict
    got, want = _unwrap(got), _unwrap(want)
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
        )
        assert torch.equal(bits(got), bits(want)), f"{where}: values differ"
        assert got.device.type == "cpu", where
    elif isinstance(want, dict | TensorDictBase):
        assert sorted(got.keys()) == sorted(want.keys()), f"{where}: keys {sorted(got.keys())}"
        for k in want.keys():
            assert_same_value(
                got.get(k) if isinstance(got, TensorDictBase) else got[k],
                want.get(k) if isinstance(want, TensorDictBase) else want[k],
                f"{where}.{k}",
            )
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def assert_matches(result: dict, expected: dict[str, list]) -> None:
    assert list(result) == list(expected), f"filenames {list(result)} != {list(expected)}"
    for name, items in expected.items():
        f = result[name]
        assert f.frame_idx.dtype == torch.int64
        assert f.frame_idx.tolist() == [i for i, _ in items], name
        for row, (idx, v) in enumerate(items):
            assert_same_value(f.frames[row], v, f"{name}[{idx}]")


def _portable(obj, back: bool = False):
    """Tensors as (dtype, shape, raw bytes): gather_object cannot unpickle float8 storages."""
    if back and isinstance(obj, tuple) and len(obj) == 4 and obj[0] == "__tensor__":
        _, dt, shape, raw = obj
        return raw.view(getattr(torch, dt)).reshape(shape)
    if not back and isinstance(obj, torch.Tensor):
        return ("__tensor__", str(obj.dtype).removeprefix("torch."), tuple(obj.shape), bits(obj).clone())
    if back and isinstance(obj, tuple) and obj and obj[0] == "__tc__":
        return DepthMask(**_portable(obj[1], True), batch_size=[])
    if isinstance(obj, dict):
        return {k: _portable(v, back) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_portable(v, back) for v in obj)
    if hasattr(obj, "_tensordict"):
        fields = {k: _portable(getattr(obj, k), back) for k in obj._tensordict.keys()}
        return ("__tc__", fields)
    return obj


def _gather_reference(p: dict) -> list | None:
    """gather_object of the same predictions (tensors carried as raw bytes, rebuilt bit-exactly)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    objs = [None] * world if rank == 0 else None
    dist.gather_object(_portable(p), objs, dst=0)
    return [_portable(o, back=True) for o in objs] if objs is not None else None


def case_compare(scenario: str) -> dict | None:
    """Gather a scenario both ways; on rank 0 assert the results are the same."""
    rank, world = dist.get_rank(), dist.get_world_size()
    p = predictions(scenario, rank, world)
    objs = _gather_reference(p)
    result = tdgather.gather(p, timeout=60)
    if rank != 0:
        assert result is None
        return None
    expected = reference(objs)
    assert_matches(result, expected)
    sent = sum(len(_pairs(e)) for o in objs for e in o.values())
    return {
        "frames": result.stats.frames,
        "sent": sent,
        "duplicates": result.stats.duplicates_dropped,
        "per_rank": {str(k): v for k, v in result.stats.frames_per_rank.items()},
    }


def case_error(scenario: str, duplicates: str = "keep") -> dict:
    """Gather a scenario that must fail; return each rank's error type and message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        tdgather.gather(predictions(scenario, rank, world), timeout=60, duplicates=duplicates)
    except tdgather.TdgatherError as e:
        received = getattr(e, "received", None)
        kept = {n: f.frame_idx.tolist() for n, f in received.items()} if received is not None else None
        return {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None), "received": kept}
    return {"type": None, "message": "", "rank": None}


def case_store(n_batches: int) -> dict | None:
    """A FrameStore filled with add() batches of nested outputs, vs gather_object of the same frames."""
    rank = dist.get_rank()
    store, plain = tdgather.FrameStore(), {}
    for b in range(n_batches):
        names = [f"vid_{(b + k) % 3}.mp4" for k in range(4)]
        idx = torch.tensor([rank * 1000 + b * 4 + k for k in range(4)])
        depth = torch.stack([value(n, int(i), (1, 3)) for n, i in zip(names, idx, strict=True)])
        mask = depth[:, 0] > 0
        store.add(names, idx, TensorDict({"depth": depth, "mask": mask}, batch_size=[4]))
        for k, (n, i) in enumerate(zip(names, idx.tolist(), strict=True)):
            plain.setdefault(n, []).append((i, {"depth": depth[k], "mask": mask[k]}))
    objs = _gather_reference(plain)
    result = tdgather.gather(store, timeout=60)
    if rank == 0:
        assert_matches(result, reference(objs))
        return {"frames": result.stats.frames}
    return None


def case_no_unpickle(scenario: str) -> dict | None:
    """Rank 0 gathers with every unpickling entry point made to fail, and audits find_class."""
    import pickle

    rank, world = dist.get_rank(), dist.get_world_size()
    p = predictions(scenario, rank, world)
    objs = _gather_reference(p)
    if rank != 0:
        assert tdgather.gather(p, timeout=60) is None
        return None
    events: list[str] = []
    state = {"on": False}

    def audit(event, args):
        if state["on"] and event.startswith("pickle."):
            events.append(event)

    sys.addaudithook(audit)

    def forbidden(*a, **k):
        raise AssertionError("unpickling during tdgather.gather")

    class NoUnpickler:
        def __init__(self, *a, **k):
            forbidden()

    saved = (pickle.loads, pickle.load, pickle.Unpickler)
    pickle.loads, pickle.load, pickle.Unpickler = forbidden, forbidden, NoUnpickler
    state["on"] = True
    try:
        result = tdgather.gather(p, timeout=60)
    finally:
        state["on"] = False
        pickle.loads, pickle.load, pickle.Unpickler = saved
    assert events == [], events
    assert_matches(result, reference(objs))
    # the audit hook does see real unpickling, so the empty list above means something
    state["on"] = True
    pickle.loads(pickle.dumps(torch.zeros(1)))
    state["on"] = False
    assert "pickle.find_class" in events
    return {"frames": result.stats.frames}


# ---- streaming (Collector) cases -------------------------------------------------------------


def stream_batches(rank: int, world: int, files: int = 12, per_file: int = 40, shape=(3, 16, 16), batch: int = 8):
    """DistributedSampler-style batches: round-robin frames, the last rank padded with repeats."""
    total = files * per_file
    positions = list(range(rank, total, world))
    padded = -(-total // world) * world
    positions += [p - total for p in range(total, padded) if p % world == rank]  # padding repeats the start
    for i in range(0, len(positions), batch):
        chunk = positions[i : i + batch]
        names = [f"video_{p // per_file:03d}.mp4" for p in chunk]
        idx = [p % per_file for p in chunk]
        frames = torch.stack([value(n, j, shape) for n, j in zip(names, idx, strict=True)])
        yield names, idx, frames


def _stream_store(rank, world, **kw) -> tdgather.FrameStore:
    store = tdgather.FrameStore()
    for names, idx, frames in stream_batches(rank, world, **kw):
        store.add(names, idx, frames)
    return store


def case_stream_vs_gather(out: str, budget: int, chunk: int, shape: tuple = (3, 16, 16)) -> dict | None:
    """The same frames through Collector (many spills) and through gather(); equal on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = tdgather.gather(_stream_store(rank, world, shape=shape), timeout=60)
    with tdgather.Collector(out, memory_budget=budget, chunk_bytes=chunk, timeout=60, progress=False) as col:
        for names, idx, frames in stream_batches(rank, world, shape=shape):
            col.add(names, idx, frames)
        col.update({f"extra_{rank}.jpg": (rank, value("extra", rank, (3, 16, 16)))})
    if rank != 0:
        assert col.summary is None
        return None
    reference_extra = {f"extra_{r}.jpg": [(r, value("extra", r, (3, 16, 16)))] for r in range(world)}
    ds = tdgather.open(out)
    assert sorted(ds) == sorted([*reference, *reference_extra])
    for name, f in reference.items():
        got = ds[name]
        assert torch.equal(got.frame_idx, f.frame_idx), name
        assert_same_value(got.frames, f.frames, name)
    s = col.summary
    assert s.frames == reference.stats.frames + world
    assert s.duplicates_dropped == reference.stats.duplicates_dropped
    segments = max(len(e["segments"]) for e in ds.index["files"].values())
    return {
        "shards": s.shards,
        "segments": segments,
        "dups": s.duplicates_dropped,
        "frames": s.frames,
        "per_rank": {str(k): v for k, v in s.frames_per_rank.items()},
    }


def case_zero_byte_leaf(out: str) -> dict | None:
    """A leaf of zero bytes a frame (``[0, 3]``) beside a 16 KiB one, streamed: the large rows are
    written by reference (`tdgather.core.merge.Rows`), the empty leaf with them; copies compared."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def batch(b: int) -> tuple[list[str], torch.Tensor, dict]:
        idx = torch.arange(8) * world + rank + 8 * world * b  # the ranks' frames interleaved
        x = torch.stack([torch.full((64, 64), float(i)) for i in idx.tolist()])
        return ["v.mp4"] * 8, idx, {"x": x, "empty": torch.zeros(8, 0, 3, dtype=torch.float16)}

    with tdgather.Collector(
        out, memory_budget=1 << 20, chunk_bytes=64 << 10, duplicates="exact", timeout=60, progress=False
    ) as col:
        for b in range(6):
            col.add(*batch(b))
        col.add(*batch(0))  # every frame of the first batch again: copies, compared bit for bit
    if rank != 0:
        return None
    got = tdgather.open(out)["v.mp4"]
    n = 6 * 8 * world
    assert got.frame_idx.tolist() == list(range(n))
    assert got.frames["empty"].shape == (n, 0, 3) and got.frames["empty"].dtype == torch.float16
    assert torch.equal(got.frames["x"], torch.arange(n, dtype=torch.float32).view(n, 1, 1).expand(n, 64, 64))
    return {"shards": col.summary.shards, "dups": col.summary.duplicates.exact}


class SlowWriter(DatasetWriter):
    """A sink that takes 0.3 s per write: rank 0 writes slowly."""

    def write(self, frames, *args, **kwargs):
        time.sleep(0.3)
        return super().write(frames, *args, **kwargs)


def case_backpressure(out: str) -> dict:
    """Rank 0 writes slowly; a sender must wait in add() instead of queueing more than max_pending."""
    rank = dist.get_rank()
    waited = 0.0
    with tdgather.Collector(
        out,
        memory_budget=1 << 20,
        chunk_bytes=64 << 10,
        max_pending=2,
        timeout=60,
        progress=False,
        sink=SlowWriter,
    ) as col:
        if rank == 1:
            for b in range(40):  # 40 chunks of 96 KB
                t = time.perf_counter()
                col.add([f"f{b}"] * 8, list(range(8)), torch.full((8, 3000), float(b)))
                waited += time.perf_counter() - t
            peak = col.status().pending_peak
    if rank == 1:
        return {"peak": peak, "waited": waited}
    return {"frames": col.summary.frames if col.summary else None}


def case_memory(out: str, budget: int, per_sender_mb: int, ragged: bool = False) -> dict | None:
    """Senders stream per_sender_mb each; rank 0 samples its resident memory while it collects.

    Frames are ``[3, 64, 64]`` float32, or (``ragged``) instance masks ``[N_i, 64, 64]`` with N_i in 0..6.
    """
    from benchmarks.memory import PeakSampler

    rank = dist.get_rank()
    frame = (3, 64, 64)
    n = per_sender_mb * 1_000_000 // (3 * 64 * 64 * 4)
    sampler = PeakSampler() if rank == 0 else None
    with tdgather.Collector(out, memory_budget=budget, timeout=120, progress=False) as col:
        if rank != 0:
            for i in range(0, n, 32):
                k = min(32, n - i)
                frames = torch.full((k, *frame), float(rank))
                if ragged:
                    lengths = torch.arange(i, i + k) % 7
                    values = torch.full((int(lengths.sum()), 64, 64), float(rank))
                    frames = torch.nested.nested_tensor_from_jagged(
                        values, torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
                    )
                col.add([f"r{rank}_{(i + j) // 100}.mp4" for j in range(k)], [(i + j) % 100 for j in range(k)], frames)
    if rank != 0:
        return None
    peak = sampler.close()
    return {"anon": peak["RssAnon"], "file": peak["RssFile"], "bytes": col.summary.bytes, "shards": col.summary.shards}


def case_small_frames(out: str, budget: int, chunk: int, shard_bytes: int, videos: int = 500) -> dict | None:
    """40 frames of 32 bytes for each of ``videos`` videos, over a shuffled ``DistributedSampler``: every chunk
    holds frames of most videos. Rank 0 checks every frame read back and returns what was written."""
    from torch.utils.data import DistributedSampler

    rank, per_video = dist.get_rank(), 40
    mine = torch.tensor(list(DistributedSampler(range(videos * per_video), shuffle=True, seed=0)))
    names = [f"video_{v:04d}.mp4" for v in range(videos)]
    kw = {"memory_budget": budget, "chunk_bytes": chunk, "max_shard_bytes": shard_bytes}
    with tdgather.Collector(out, timeout=120, progress=False, **kw) as col:
        for i in range(0, mine.numel(), 32):
            pos = mine[i : i + 32]
            col.add([names[v] for v in (pos // per_video).tolist()], pos % per_video, pos[:, None] + torch.arange(8.0))
    if rank != 0:
        return None
    ds = tdgather.open(out)
    assert sorted(ds) == names
    for v in range(0, videos, 7):
        got = ds[names[v]]
        assert got.frame_idx.tolist() == list(range(per_video))
        assert torch.equal(got.frames, (v * per_video + torch.arange(per_video))[:, None] + torch.arange(8.0))
    s = col.summary
    segments = max(len(e["segments"]) for e in ds.index["files"].values())
    return {"shards": s.shards, "segments": segments, "bytes": s.bytes, "frames": s.frames}


def case_stream_error(out: str, failing_rank: int) -> dict:
    """failing_rank raises inside the with block after sending several chunks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        with tdgather.Collector(out, memory_budget=1 << 20, chunk_bytes=32 << 10, timeout=30, progress=False) as col:
            for b, (names, idx, frames) in enumerate(stream_batches(rank, world, files=20)):
                if rank == failing_rank and b == 20:
                    raise RuntimeError(f"boom on rank {rank}")
                col.add(names, idx, frames)
    except Exception as e:
        # a launcher stops every process once one exits with an error: by the time the failing rank's
        # Collector returns, rank 0 has listed what it saved
        listed = os.path.exists(os.path.join(out + ".partial", "tdgather.incomplete.json"))
        return {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None), "listed": listed}
    return {"type": None}


def case_stream_mismatch(out: str, when: str) -> dict:
    """``odd.mp4`` comes with two layouts; return each rank's error and, on rank 0, what ``.partial`` holds.

    ``when``: ``"same_spill"``, ranks 1 and 2 send it first, into one spill; ``"on_disk"``, rank 1
    sends it first and rank 2 after all its frames, a spill later; ``"in_rank"``, rank 1 adds it
    as ``float32[4]`` then ``float32[4, 1]`` into one chunk after 10 batches; ``"in_rank_later"``,
    the first at the start, the second after 10 batches (chunks apart).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    budget = 64 << 20 if when == "same_spill" else 1 << 20
    odd = {1: (0, value("odd.mp4", 0, (4,))), 2: (1, value("odd.mp4", 1, (4, 1)))}  # a dim after the first: no fit
    added: dict[str, dict[int, torch.Tensor]] = {}
    error = None
    try:
        with tdgather.Collector(out, memory_budget=budget, chunk_bytes=32 << 10, timeout=60, progress=False) as col:
            if (rank == 1 and when != "in_rank") or (rank == 2 and when == "same_spill"):
                col.update({"odd.mp4": odd[rank]})
                added["odd.mp4"] = {odd[rank][0]: odd[rank][1]}
            for b, (names, idx, frames) in enumerate(stream_batches(rank, world, files=20)):
                if when.startswith("in_rank") and rank == 1 and b == 10:
                    if when == "in_rank":
                        col.update({"odd.mp4": odd[1]})
                        added["odd.mp4"] = {0: odd[1][1]}
                    col.update({"odd.mp4": odd[2]})
                col.add(names, idx, frames)
                for name, i, frame in zip(names, idx, frames, strict=True):
                    added.setdefault(name, {})[i] = frame
            if rank == 2 and when == "on_disk":
                col.update({"odd.mp4": odd[rank]})
    except tdgather.TdgatherError as e:
        error = {"type": type(e).__name__, "message": str(e), "rank": getattr(e, "rank", None)}
    out_added = [None] * world
    dist.all_gather_object(out_added, {n: sorted(f) for n, f in added.items()})  # the test's own bookkeeping
    if rank != 0:
        return {"error": error}
    ds = tdgather.open(out + ".partial", incomplete=True)
    saved = {name: ds[name] for name in ds}
    expected = {"odd.mp4": value("odd.mp4", 0, (4,))}  # rank 1's, the lowest rank's layout
    for name, f in saved.items():
        for i, frame in zip(f.frame_idx.tolist(), f.frames, strict=True):
            want = expected.get(name) if name == "odd.mp4" else value(name, i, (3, 16, 16))
            assert torch.equal(frame, want), (name, i)
    return {
        "error": error,
        "saved": {n: f.frame_idx.tolist() for n, f in saved.items()},
        "added": out_added,
        "received": ds.metadata["frames_per_rank"],
    }


def case_stream_open(out: str, overwrite: bool) -> dict:
    rank = dist.get_rank()
    try:
        with tdgather.Collector(out, overwrite=overwrite, timeout=30, progress=False) as col:
            col.update({f"new_{rank}": (0, torch.ones(2))})
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


# ---- many ranks, and an NCCL-style default group --------------------------------------------


def case_many_ranks(out: str) -> dict | None:
    """gather() and a Collector in one world of any size; rank 0 checks both against the inputs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    p = predictions("split", rank, world)
    p.update(predictions("uneven", rank, world))
    result = tdgather.gather(p, timeout=120)
    with tdgather.Collector(out, timeout=120, chunk_bytes=1024, progress=False) as col:
        col.update(p)
    if rank != 0:
        return None
    expected = reference([{**predictions("split", r, world), **predictions("uneven", r, world)} for r in range(world)])
    assert_matches(result, expected)
    ds = tdgather.open(out)
    assert_matches({name: ds[name] for name in ds}, expected)
    return {"frames": result.stats.frames, "ranks_sending": sum(1 for n in result.stats.frames_per_rank.values() if n)}


def case_side_group(backend: str) -> dict | None:
    """The default group reports ``backend``: tdgather makes one side gloo group and reuses it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    made = []
    real_new_group, real_get_backend = dist.new_group, dist.get_backend

    def new_group(*a, **k):
        made.append(k.get("backend"))
        return real_new_group(*a, **k)

    dist.new_group = new_group
    dist.get_backend = lambda group=None: backend if group in (None, dist.group.WORLD) else real_get_backend(group)
    try:
        for _ in range(3):
            result = tdgather.gather(predictions("uneven", rank, world), timeout=60)
    finally:
        dist.new_group, dist.get_backend = real_new_group, real_get_backend
    if rank == 0:
        assert_matches(result, reference([predictions("uneven", r, world) for r in range(world)]))
    return {"made": made}


def case_writer_per_node(out: str, ranks_per_node: int) -> dict:
    """One Collector per "node" (a subgroup of consecutive ranks): each node's first rank writes its part."""
    rank, world = dist.get_rank(), dist.get_world_size()
    node_group, _ = dist.new_subgroups(group_size=ranks_per_node, backend="gloo")
    node = rank // ranks_per_node
    p = predictions("uneven", rank, world)
    with tdgather.Collector(f"{out}/node-{node}", group=node_group, group_dst=0, timeout=60, progress=False) as col:
        col.update(p)
    return {"node": node, "wrote": col.summary is not None}


def wire_roundtrip(store: tdgather.FrameStore, rank: int = 0):
    """A store packed, its data message validated as rank dst does, its pieces joined: (parts, packed).

    The wire without gloo: every step of the receive path but the transport itself.
    """
    from tdgather.comm.pack import pack
    from tdgather.comm.protocol import Joiner, as_bytes
    from tdgather.comm.wire import Kind, Limits, decode_header, decode_index, decode_json, encode_json
    from tdgather.core.part import Part

    packed = pack(store)
    parsed = decode_json(encode_json(packed.header), rank, Limits())
    header = decode_header(parsed, Kind.DATA, rank, 0 if packed.index is None else packed.index.numel())
    index = decode_index(header, packed.index, rank)
    columns = [
        [torch.empty((n, *x.shape), dtype=x.dtype) for n, x in zip(g.elems, g.layout.leaves, strict=True)]
        for g in header.groups
    ]
    for (g, j, first, rows), piece in zip(header.pieces(), packed.pieces, strict=True):
        as_bytes(columns[g][j][first : first + rows]).copy_(Joiner(reuse=False).join(None, piece))
    parts = [
        Part(rank, g.layout, list(header.files), ids, idx, list(g.json), [columns[k]], lengths)
        for k, (g, (ids, idx, lengths)) in enumerate(zip(header.groups, index, strict=True))
    ]
    return parts, packed


def case_slow_placement(world_frames: int, early_bytes: int) -> dict | None:
    """Rank 0 places slowly: pieces come while it places, land early (up to early_bytes), scattered after."""
    receive_module = sys.modules["tdgather.api.receive"]  # rank dst's side of gather, which places
    rank, world = dist.get_rank(), dist.get_world_size()
    place, default_early = receive_module.place, receive_module.Landing.EARLY_BYTES

    def slow_place(parts, *args, **kwargs):
        time.sleep(0.5)
        return place(parts, *args, **kwargs)

    if rank == 0:  # the placement (a public function of core.plan, as rank dst's side calls it) made slow
        receive_module.place, receive_module.Landing.EARLY_BYTES = slow_place, early_bytes
    store = tdgather.FrameStore()
    mine = [p for p in range(world_frames) if p % world == rank] + ([0] if rank == world - 1 else [])  # + a copy
    for start in range(0, len(mine), 64):
        batch = mine[start : start + 64]
        names = [f"v{p // 500}.mp4" for p in batch]
        idx = [p % 500 for p in batch]
        store.add(names, idx, torch.stack([value(n, i, (64,)) for n, i in zip(names, idx, strict=True)]))
    try:
        result = tdgather.gather(store, timeout=60)
    finally:
        receive_module.place, receive_module.Landing.EARLY_BYTES = place, default_early
    if rank != 0:
        return None
    for name, f in result.items():
        assert torch.equal(f.frames, torch.stack([value(name, int(i), (64,)) for i in f.frame_idx])), name
    s = result.stats
    return {"frames": s.frames, "dups": s.duplicates_dropped, "early": s.early_pieces, "pieces": s.pieces}


def plain_read(out: Path) -> dict:
    """Every filename's (frame_idx, tensors of the group) rows, read with safetensors and the index alone."""
    index = json.loads((Path(out) / "tdgather.index.json").read_text())
    result = {}
    for name, entry in index["files"].items():
        rows = []
        for seg in entry["segments"]:
            lo, hi = seg["start"], seg["start"] + seg["frames"]
            with safe_open(Path(out) / seg["shard"], framework="pt") as f:
                idx = f.get_slice(f"{seg['group']}:frame_idx")[lo:hi]
                keys = set(f.keys())  # fixed-size leaves only: ragged values and JSON lines (with offsets) are left out
                mine = (k for k in keys if k == seg["group"] or k.startswith(seg["group"] + "."))
                leaves = sorted(k for k in mine if ":" not in k and f"{k}:offsets" not in keys)
                values = [f.get_slice(k)[lo:hi] for k in leaves]
            rows += [(int(i), [bits(v[r]) for v in values]) for r, i in enumerate(idx)]
        result[name] = sorted(rows, key=lambda r: r[0])
    return result


def case_conflict_across_spills(out: str) -> dict:
    """Rank 2 sends x.jpg frame 0, which is written; then rank 1 another value of it, and rank 0 frame 5 (``exact``)."""
    import time

    rank = dist.get_rank()
    try:
        with tdgather.Collector(out, duplicates="exact", memory_budget=64 << 10, timeout=60, progress=False) as col:
            col.add([f"own_{rank}.jpg"], [0], torch.full((1, 4), float(rank)))
            if rank == 2:
                col.add(["x.jpg"], [0], torch.zeros(1, 4))
                col.add([f"pad_{i}.jpg" for i in range(4000)], list(range(4000)), torch.zeros(4000, 4))
            if rank < 2:  # only once x.jpg is in a shard: the copies meet across spills
                deadline = time.monotonic() + 50
                while not list(Path(out + ".partial").glob("shard-*.safetensors")) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if rank == 1:
                    col.add(["x.jpg"], [0], torch.ones(1, 4))
                else:  # another frame of x.jpg in the same spill, from another rank: not named
                    col.add(["x.jpg"], [5], torch.zeros(1, 4))
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


def case_gather_conflict_names_each_copy() -> dict | None:
    """Ranks 0 and 1 send the same x.jpg frame 0, rank 2 another value of it."""
    rank = dist.get_rank()
    preds = {"x.jpg": (0, torch.full((3,), 1.0 if rank == 2 else 0.0)), f"own_{rank}.jpg": (0, torch.zeros(3))}
    try:
        tdgather.gather(preds, duplicates="exact")
    except tdgather.DuplicateFrameError as e:
        return {"message": str(e)}
    except Exception as e:  # the other ranks learn of it from rank 0
        return {"other": type(e).__name__}
    return None
