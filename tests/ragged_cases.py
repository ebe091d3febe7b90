"""Detections (a variable number of boxes per frame) spread over ranks, and the world cases that gather them.

Every rank derives the whole job from one seed, so rank 0 knows what each frame must be:
per frame ``N_i`` boxes (0 included), scores and labels, and a fixed 16-float embedding.
Frames go to ranks as a shuffled ``DistributedSampler(drop_last=False)`` gives them, padding
included; the padded copies ran "in another batch": their embedding differs in the last bit,
and with ``fewer=True`` they also lost their last box.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tdgather
from tdgather.core.ragged import Ragged

FEAT = 16
DETECTIONS = ["boxes", "scores", "labels"]  # the ragged leaves


class Job:
    """The frames of a detection job and who holds which copy."""

    def __init__(self, files: int, per_file: int, max_boxes: int, world: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.files, self.per_file, self.world = files, per_file, world
        total = files * per_file
        self.lengths = torch.randint(0, max_boxes + 1, (total,), generator=g)
        rows = int(self.lengths.sum())
        self.boxes = Ragged.from_lengths(torch.rand(rows, 4, generator=g) * 640, self.lengths)
        self.scores = Ragged.from_lengths(torch.rand(rows, generator=g), self.lengths)
        self.labels = Ragged.from_lengths(torch.randint(0, 80, (rows,), generator=g), self.lengths)
        self.feat = torch.rand(total, FEAT, generator=g)
        order = torch.randperm(total, generator=g)
        pad = -total % world
        self.order = torch.cat([order, order[:pad]])  # sampler position -> frame
        self.total = total
        # the copy kept of each frame: the lowest rank's (then the first position)
        pos = torch.arange(self.order.numel())
        key = (pos % world) * (1 << 40) + pos
        kept = torch.full((total,), 1 << 62, dtype=torch.int64).scatter_reduce(0, self.order, key, "amin")
        self.kept_padded = kept % (1 << 40) >= total

    def name(self, frame: int) -> str:
        return f"clip_{frame // self.per_file:04d}.mp4"

    def batches(self, rank: int, batch: int, form: str, fewer: bool = False):
        """Rank ``rank``'s ``(filenames, frame_idx, frames)`` batches; ``form``: "nested", "list" or "lazy"."""
        positions = torch.arange(rank, self.order.numel(), self.world)
        for lo in range(0, positions.numel(), batch):
            pos = positions[lo : lo + batch]
            frames = self.order[pos]
            padded = pos >= self.total
            yield (
                [self.name(f) for f in frames.tolist()],
                frames % self.per_file,
                self.frames(frames, padded, fewer, form),
            )

    def frames(self, frames: torch.Tensor, padded: torch.Tensor, fewer: bool, form: str):
        boxes, scores, labels = (r.index_select(0, frames) for r in (self.boxes, self.scores, self.labels))
        feat = self.feat[frames].clone()
        feat[padded] = torch.nextafter(feat[padded], torch.tensor(2.0))  # a last-bit difference
        if fewer and bool(padded.any()):
            boxes, scores, labels = (_drop_last_row(r, padded) for r in (boxes, scores, labels))
        if form == "nested":
            return {
                "boxes": boxes.to_nested(),
                "scores": scores.to_nested(),
                "labels": labels.to_nested(),
                "feat": feat,
            }
        per_frame = [
            {"boxes": b, "scores": s, "labels": lab, "feat": f}
            for b, s, lab, f in zip(
                boxes.to_nested().unbind(), scores.to_nested().unbind(), labels.to_nested().unbind(), feat, strict=True
            )
        ]
        if form == "lazy":
            from tensordict import LazyStackedTensorDict, TensorDict

            return LazyStackedTensorDict.lazy_stack([TensorDict(d) for d in per_frame])
        return per_frame

    def expected(self, name: str, fewer: bool = False) -> dict:
        """What rank 0 must hold for ``name``: each leaf over its frames (lowest rank's copy)."""
        file = int(name[5:9])
        frames = torch.arange(file * self.per_file, (file + 1) * self.per_file)
        d = self.frames(frames, self.kept_padded[frames], fewer, "nested")
        return {k: Ragged.from_nested(v, k) if v.is_nested else v for k, v in d.items()}


def _drop_last_row(r: Ragged, which: torch.Tensor) -> Ragged:
    keep = torch.ones(r.num_rows, dtype=torch.bool)
    ends = r.offsets[1:] - 1
    gone = ends[which & (r.lengths > 0)]
    keep[gone] = False
    lengths = r.lengths - (which & (r.lengths > 0)).long()
    return Ragged.from_lengths(r.span()[0][keep], lengths)


def same_bits(got, want: Ragged | torch.Tensor, where: str) -> None:
    """Bit-exact: a nested tensor against a `Ragged`, or two tensors."""
    if isinstance(want, Ragged):
        assert got.is_nested, where
        got = Ragged.from_nested(got, where)
        assert torch.equal(got.lengths, want.lengths), where
        got, want = got.span()[0], want.span()[0]
    assert got.dtype == want.dtype and got.shape == want.shape, (where, got.shape, want.shape)
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), where


def check_result(job: Job, result, fewer: bool = False) -> None:
    """Every filename's frames on rank 0, in order, bit-exact, one copy each."""
    assert sorted(result) == sorted({job.name(f) for f in range(job.total)})
    for name in result:
        f = result[name]
        assert torch.equal(f.frame_idx, torch.arange(job.per_file)), name
        for key, want in job.expected(name, fewer).items():
            same_bits(f.frames[key], want, f"{name} {key}")


def case_gather(files: int, per_file: int, max_boxes: int, batch: int, form: str, fewer: bool = False) -> dict | None:
    """gather() of detections, then save and open: all bit-exact on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    job = Job(files, per_file, max_boxes, world)
    store = tdgather.FrameStore()
    for names, idx, frames in job.batches(rank, batch, form, fewer):
        store.add(names, idx, frames, ragged=DETECTIONS)
    result = tdgather.gather(store, timeout=120)
    if rank != 0:
        return None
    check_result(job, result, fewer)
    return {"dups": result.stats.duplicates.to_json(), "frames": result.stats.frames}


def case_save_and_stream(out: str, files: int, per_file: int, max_boxes: int, budget: int) -> dict | None:
    """The same detections through a Collector (many spills) and through gather() + save: equal on disk."""
    rank, world = dist.get_rank(), dist.get_world_size()
    job = Job(files, per_file, max_boxes, world)
    with tdgather.Collector(out, memory_budget=budget, chunk_bytes=budget // 16, timeout=120, progress=False) as col:
        for names, idx, frames in job.batches(rank, 8, "nested"):
            col.add(names, idx, frames)
    store = tdgather.FrameStore()
    for names, idx, frames in job.batches(rank, 8, "list"):
        store.add(names, idx, frames, ragged=DETECTIONS)
    gathered = tdgather.gather(store, timeout=120)
    if rank != 0:
        return None
    tdgather.save(gathered, out + "_saved")
    streamed, saved = tdgather.open(out), tdgather.open(out + "_saved")
    streamed.verify()
    check_result(job, streamed)
    check_result(job, saved)
    segments = max(len(e["segments"]) for e in streamed.index["files"].values())
    return {"segments": segments, "shards": len(streamed.index["shards"]), "dups": col.summary.duplicates_dropped}


def _cut_batches(rank: int) -> dict[str, Ragged]:
    """Rank ``rank``'s 4 batches of 64 frames of 1200-2999 boxes (the first 3 of each none), by filename.

    Each batch is over `PIECE_MIN` bytes: one piece of its own.
    """
    g = torch.Generator().manual_seed(rank)
    out = {}
    for b in range(4):
        lengths = torch.randint(1200, 3000, (64,), generator=g)
        lengths[:3] = 0
        out[f"r{rank}_b{b}.mp4"] = Ragged.from_lengths(torch.rand(int(lengths.sum()), 4, generator=g), lengths)
    return out


def case_cut_mid_values(tmp: str) -> dict | None:
    """Rank 1 dies after 3 pieces (its fixed leaf, then 2 of its 4 batches of boxes): rank 0 keeps what landed whole."""
    import os
    import signal
    import time

    from tdgather.comm.wire import MAGIC, PRELUDE_LEN, Kind

    rank = dist.get_rank()
    store = tdgather.FrameStore()
    for b, (name, boxes) in enumerate(_cut_batches(rank).items()):
        store.add([name] * 64, torch.arange(64), {"a": torch.full((64, 2), float(b)), "boxes": boxes.to_nested()})
    if rank == 1:
        real, seen = dist.isend, {"pieces": 0}

        def isend(t, group=None, group_dst=None):
            if t.dtype == torch.int64 and t.numel() == PRELUDE_LEN and int(t[0]) == MAGIC and int(t[2]) == Kind.PIECE:
                seen["pieces"] += 1
                if seen["pieces"] == 4:
                    time.sleep(1.0)  # the three pieces before reach rank 0
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(t, group=group, group_dst=group_dst)

        dist.isend = isend
    try:
        tdgather.gather(store, timeout=20)
    except tdgather.TdgatherError as e:
        if rank != 0:
            return None
        got, sent = e.received, {**_cut_batches(0), **_cut_batches(1)}
        for name, f in got.items():
            same_bits(f.frames["boxes"], sent[name].index_select(0, f.frame_idx), name)
        return {"type": type(e).__name__, "frames": {name: len(got[name]) for name in got}}
    return {"type": None}


def _dict_of(job: Job, rank: int) -> dict:
    """Rank ``rank``'s frames as ``{filename: [(frame_idx, {"boxes": [N_i, 4], ...}), ...]}``."""
    out: dict = {}
    for names, idx, frames in job.batches(rank, 8, "list"):
        for name, i, frame in zip(names, idx.tolist(), frames, strict=True):
            out.setdefault(name, []).append((i, frame))
    return out


def case_dict_form(out: str) -> dict | None:
    """The ``{filename: [(frame_idx, value)]}`` form with ``ragged=``: gather() and Collector.update()."""
    rank, world = dist.get_rank(), dist.get_world_size()
    job = Job(5, 9, 5, world)
    preds = _dict_of(job, rank)
    gathered = tdgather.gather(preds, timeout=60, ragged=DETECTIONS)
    with tdgather.Collector(out, timeout=60, progress=False) as col:
        col.update(preds, ragged=DETECTIONS)
    if rank != 0:
        return None
    check_result(job, gathered)
    check_result(job, tdgather.open(out))
    return {"frames": gathered.stats.frames}
