"""Per-rank cases of what a new user does on day one, run in real gloo worlds (tests/test_new_user.py).

The seed scenario: a shuffled ``DistributedSampler`` (with padding) over (video, frame) pairs,
the default DataLoader collate, and a real convolutional model run in batches.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import tdgather
from tdgather.tools.demo import DemoNet, video_frames

LENGTHS = [7, 11, 5, 9]  # 32 pairs: over 3 ranks, DistributedSampler pads 1; over 5 ranks, 3
SIZE = 24


class VideoFrames(Dataset):
    """Every (video, frame) pair of LENGTHS, as a DataLoader sample."""

    def __init__(self) -> None:
        self.pairs = [(v, t) for v, n in enumerate(LENGTHS) for t in range(n)]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        v, t = self.pairs[i]
        return {"filename": f"video_{v:02d}.mp4", "frame_idx": t, "video": video_frames(0, v, [t], SIZE)[0]}


def _error(e: BaseException, **extra) -> dict:
    """What a rank reports of its error."""
    return {"type": type(e).__name__, "rank": getattr(e, "rank", None), "message": str(e), **extra}


def _model() -> DemoNet:
    torch.manual_seed(0)
    return DemoNet().eval()


def _loader(batch_size: int = 4) -> DataLoader:
    data = VideoFrames()
    sampler = DistributedSampler(data, shuffle=True, seed=3, drop_last=False)
    return DataLoader(data, batch_size=batch_size, sampler=sampler)  # default collate: list[str], LongTensor


def _check_against_one_process(frames: dict) -> float:
    """Every pair exactly once, each frame close to the model run on it alone; return the largest difference."""
    model, worst = _model(), 0.0
    assert sorted(frames) == [f"video_{v:02d}.mp4" for v in range(len(LENGTHS))]
    for v, n in enumerate(LENGTHS):
        got = frames[f"video_{v:02d}.mp4"]
        assert got.frame_idx.tolist() == list(range(n))
        with torch.inference_mode():
            want = model(video_frames(0, v, list(range(n)), SIZE))
        worst = max(worst, float((got.frames["depth"] - want["depth"]).abs().max()))
        assert torch.equal(got.frames["seg"], want["seg"]) or worst < 1e-4
    assert worst < 1e-5
    return worst


def case_seed(how: str, out: str, duplicates: str = "keep") -> dict | None:
    """The seed scenario through ``gather`` + ``save`` or through a ``Collector``."""
    _rank, model = dist.get_rank(), _model()
    padding = -len(VideoFrames()) % dist.get_world_size()
    if how == "gather":
        store = tdgather.FrameStore()
        for batch in _loader():
            with torch.inference_mode():
                store.add(batch["filename"], batch["frame_idx"], model(batch["video"]))
        result = tdgather.gather(store, timeout=60, duplicates=duplicates)
        if result is None:
            return None
        tdgather.save(result, out)
        d = result.stats.duplicates
    else:
        with tdgather.Collector(out, timeout=60, duplicates=duplicates, progress=False, chunk_bytes=4096) as col:
            for batch in _loader():
                with torch.inference_mode():
                    col.add(batch["filename"], batch["frame_idx"], model(batch["video"]))
        if col.summary is None:
            return None
        d = col.summary.duplicates
    ds = tdgather.open(out)
    worst = _check_against_one_process(dict(ds.items()))
    assert ds.metadata["duplicates"]["exact"] == d.exact and ds.metadata["duplicates"]["inexact"] == d.inexact
    return {"padding": padding, "exact": d.exact, "inexact": d.inexact, "max_abs_diff": d.max_abs_diff, "worst": worst}


class SlowStore(tdgather.FrameStore):
    """A store whose frames take ``seconds`` to hand over: rank dst busy inside gather after its peers sent."""

    def __init__(self, seconds: float, frames: dict) -> None:
        super().__init__()
        self.seconds = seconds
        self.update(frames)

    def parts(self, rank: int):
        time.sleep(self.seconds)
        return super().parts(rank)


def case_uneven_finish(how: str, busy: str, seconds: float, timeout: float, out: str) -> dict | None:
    """Rank ``busy`` ("dst" or "sender") works ``seconds`` (several timeouts) after the others finished."""
    rank = dist.get_rank()
    slow = (busy == "dst" and rank == 0) or (busy == "sender" and rank == 2)
    frames = {f"r{rank}.mp4": [(j, torch.full((4,), float(rank))) for j in range(3)]}
    start = time.monotonic()
    if how == "collector":
        with tdgather.Collector(out, timeout=timeout, progress=False) as col:
            col.update(frames)
            if slow:  # a long inference tail: slow batches, each under the timeout (the loop progresses)
                for _ in range(round(seconds / (timeout / 2))):
                    time.sleep(timeout / 2)
                    col.status()
        summary = col.summary
        return {"frames": summary.frames if summary else None, "waited": time.monotonic() - start}
    if slow and busy == "dst":  # rank dst busy inside gather (slow to prepare its own frames): senders wait
        frames = SlowStore(seconds, frames)
    result = tdgather.gather(frames, timeout=timeout)
    return {"frames": result.stats.frames if result else None, "waited": time.monotonic() - start}


def case_dst_stops_after_senders_finished(out: str, timeout: float) -> dict | None:
    """Rank 0 stops (SIGSTOP) once its senders have closed; they must fail within the timeout, naming it."""
    rank = dist.get_rank()
    try:
        with tdgather.Collector(out, timeout=timeout, progress=False) as col:
            col.update({f"r{rank}": (0, torch.ones(2))})
            if rank == 0:
                time.sleep(0.5)
                Path(out + ".pid").write_text(str(os.getpid()))  # the test SIGKILLs it later, as torchrun would
                os.kill(os.getpid(), signal.SIGSTOP)
    except tdgather.TdgatherError as e:
        return _error(e, at=time.time())
    return {"type": None}


def case_conflict_after_shards(out: str) -> dict | None:
    """Under duplicates="exact", rank 2 sends a different copy of a frame after rank 1's was written."""
    rank = dist.get_rank()
    go = Path(out).with_name("go")
    try:
        with tdgather.Collector(
            out,
            timeout=60,
            duplicates="exact",
            chunk_bytes=1,
            memory_budget=1,
            progress=False,  # spill at once
        ) as col:
            if rank == 1:
                col.update({"x.mp4": [(0, torch.zeros(4)), (1, torch.zeros(4))], "one.mp4": (0, torch.ones(4))})
            if rank == 0:
                deadline = time.monotonic() + 30
                while not col.status().shards:
                    assert time.monotonic() < deadline, "rank 1's frames were never written"
                    time.sleep(0.01)
                go.touch()
            if rank == 2:
                while not go.exists():
                    time.sleep(0.01)
                col.update({"two.mp4": (0, torch.full((4,), 2.0))})
                col.update({"x.mp4": (1, torch.full((4,), 0.5))})  # the conflict
                col.update({"three.mp4": (0, torch.full((4,), 3.0))})
    except tdgather.TdgatherError as e:
        return _error(e)
    return {"type": None}


def case_gather_conflict_keeps_received() -> dict | None:
    rank = dist.get_rank()
    frames = {"x.mp4": (0, torch.full((2,), float(rank > 0)))}  # rank 0: zeros, the others: ones
    frames[f"own{rank}.mp4"] = (0, torch.full((2,), float(rank)))
    try:
        tdgather.gather(frames, duplicates="exact", timeout=60)
    except tdgather.TdgatherError as e:
        received = e.received
        return {
            "type": type(e).__name__,
            "message": str(e),
            "received": None if received is None else {k: v.frames.tolist() for k, v in received.items()},
        }
    return {"type": None}


def case_bad_filename_on_a_rank(how: str, out: str) -> dict | None:
    """Rank 1 hands over a filename that UTF-8 cannot encode (what os.fsdecode gives for one)."""
    rank = dist.get_rank()
    name = os.fsdecode(b"clip_\xff.mp4") if rank == 1 else f"ok{rank}.mp4"
    start = time.monotonic()
    try:
        if how == "gather":
            tdgather.gather({name: (0, torch.ones(2))}, timeout=60)
        else:
            with tdgather.Collector(out, timeout=60, progress=False) as col:
                col.add([name], [0], torch.ones(1, 2))
    except tdgather.TdgatherError as e:
        return _error(e, seconds=time.monotonic() - start)
    return {"type": None}


def case_misuse(how: str, tmp: str, timeout: float) -> dict:
    """Collective misuse: a different dst on one rank, a skipped Collector, two Collectors at once."""
    rank = dist.get_rank()
    start = time.monotonic()
    try:
        if how == "different_dst":
            tdgather.gather({f"r{rank}": (0, torch.ones(1))}, dst=1 if rank == 1 else 0, timeout=timeout)
        elif how == "skipped_collector":  # rank 2 skips epoch 1 and goes straight to epoch 2
            for epoch in (1, 2):
                if rank == 2 and epoch == 1:
                    continue
                with tdgather.Collector(f"{tmp}/epoch_{epoch}", timeout=timeout, progress=False) as col:
                    col.update({f"r{rank}": (epoch, torch.ones(1))})
        elif how == "two_collectors":
            with tdgather.Collector(f"{tmp}/pred", timeout=timeout, progress=False) as a:
                a.update({f"r{rank}": (0, torch.ones(1))})
                with tdgather.Collector(f"{tmp}/emb", timeout=timeout, progress=False) as b:
                    b.update({f"r{rank}": (0, torch.ones(1))})
        elif how == "two_collectors_two_groups":
            other = dist.new_group(backend="gloo")
            with tdgather.Collector(f"{tmp}/pred", timeout=timeout, progress=False) as a:
                with tdgather.Collector(f"{tmp}/emb", timeout=timeout, progress=False, group=other) as b:
                    a.update({f"r{rank}": (0, torch.ones(1))})
                    b.update({f"r{rank}": (0, torch.full((3,), 2.0))})
            if rank == 0:
                pred, emb = tdgather.open(f"{tmp}/pred"), tdgather.open(f"{tmp}/emb")
                return {"type": None, "pred": len(pred), "emb": len(emb), "emb_shape": list(emb["r1"].frames.shape)}
        elif how == "gather_inside_collector":
            with tdgather.Collector(f"{tmp}/pred", timeout=timeout, progress=False) as a:
                a.update({f"r{rank}": (0, torch.ones(1))})
                tdgather.gather({f"r{rank}": (0, torch.ones(1))}, timeout=timeout)
    except tdgather.TdgatherError as e:
        return _error(e, seconds=time.monotonic() - start)
    return {"type": None, "seconds": time.monotonic() - start}


def case_overwrite_user_directory(out: str) -> dict:
    """Every rank opens a Collector with overwrite=True onto a directory of the user's files."""
    rank = dist.get_rank()
    try:
        with tdgather.Collector(out, overwrite=True, timeout=60, progress=False) as col:
            col.update({f"r{rank}": (0, torch.ones(1))})
    except tdgather.TdgatherError as e:
        return _error(e)
    return {"type": None}


def case_late_open(out: str, late: float, timeout: float) -> dict:
    """Rank 1 opens its Collector ``late`` seconds after the others (a long step before the block)."""
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(late)
    try:
        with tdgather.Collector(out, timeout=timeout, progress=False) as col:
            col.update({f"r{rank}": (0, torch.ones(1))})
    except tdgather.TdgatherError as e:
        return _error(e)
    return {"type": None}


def case_dead_before_open(out: str, timeout: float) -> dict:
    """Rank 1 dies before it opens its Collector (an error in a framework's setup, say)."""
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)
    t0 = time.monotonic()
    try:
        with tdgather.Collector(out, timeout=timeout, progress=False) as col:
            col.update({f"r{rank}": (0, torch.ones(1))})
    except tdgather.TdgatherError as e:
        return {**_error(e), "seconds": time.monotonic() - t0}
    return {"type": None}


def case_sampler_overlap(out: str, same_seed: bool) -> dict:
    """23 one-frame images over a shuffling DistributedSampler, seeded alike on every rank (padding) or not."""
    from torch.utils.data import DistributedSampler

    rank, world = dist.get_rank(), dist.get_world_size()
    images = [f"img_{i:02d}.jpg" for i in range(23)]
    sampler = DistributedSampler(images, num_replicas=world, rank=rank, shuffle=True, seed=0 if same_seed else rank)
    with tdgather.Collector(out, timeout=60, progress=False) as col:
        for i in sampler:
            col.add([images[i]], [0], torch.full((1, 4), float(i)))
    s = col.summary
    if s is None:
        return {}
    return {"dropped": s.duplicates_dropped, "frames": s.frames, "warnings": list(s.warnings), "text": str(s)}
