"""World cases for gather's same-host senders that write their rows into rank dst's result."""

from __future__ import annotations

import math
import os
import zlib

import torch
import torch.distributed as dist

import tdgather


def expected(name: str, idx: torch.Tensor, shape: tuple[int, ...]) -> dict:
    """Frames ``idx`` of ``name``: the same on every rank that makes them (no random state)."""
    seed = zlib.crc32(name.encode()) % 1000
    n = math.prod(shape)
    x = (torch.arange(n, dtype=torch.float64)[None] * (idx[:, None] + 1) + seed) % 997 / 7
    return {"logits": x.float().view(-1, *shape), "label": (idx[:, None] * 3 + torch.arange(3) + seed) % 11}


BIG, TINY = (25, 1000), (3, 3)  # 100 KB and 60-byte frames (with the label)


def case_gather(env: dict, variant: str = "plain", dst: int = 0, frames_per_file: int = 30) -> dict | None:
    """Every video is split frame by frame over the ranks (rank r: frames r, r + W, ...), as
    non-contiguous rows; rank dst checks every frame bit for bit.

    ``variant``: ``"hosts"``, each rank on a host of its own (its own ``TDGATHER_SHM_DIR``); ``"ragged"``,
    the last rank also sends a file with a ragged leaf; ``"copies"``, every rank also sends frame 0 of
    each video (the same bits: ``duplicates="exact"`` passes); ``"tiny"``, frames of 60 bytes.
    """
    os.environ.update(env)
    rank, world = dist.get_rank(), dist.get_world_size()
    if variant == "hosts":
        os.environ["TDGATHER_SHM_DIR"] = os.path.join(env["TDGATHER_SHM_DIR"], str(rank))
        os.makedirs(os.environ["TDGATHER_SHM_DIR"], exist_ok=True)
    names = [f"v{k}.mp4" for k in range(4)]
    shape = TINY if variant == "tiny" else BIG
    store = tdgather.FrameStore()
    for name in names:
        idx = torch.arange(rank, frames_per_file, world)
        if variant == "copies" and rank:
            idx = torch.cat([torch.zeros(1, dtype=torch.int64), idx])
        value = expected(name, idx, shape)
        value["logits"] = value["logits"].transpose(-1, -2).contiguous().transpose(-1, -2)  # non-contiguous rows
        for batch in torch.arange(idx.numel()).split(7):  # batches of 7 frames, as a loop adds them
            store.add([name] * batch.numel(), idx[batch], {k: v[batch] for k, v in value.items()})
    if variant == "ragged" and rank == world - 1:
        for i in range(5):
            store.add("boxes.mp4", [i], {"boxes": torch.full((1, i, 4), float(i))}, ragged=True)
    out = tdgather.gather(store, dst=dst, duplicates="exact" if variant == "copies" else "keep")
    if rank != dst:
        assert out is None
        return None
    for name in names:
        got = out[name]
        want = expected(name, torch.arange(frames_per_file), shape)
        assert got.frame_idx.tolist() == list(range(frames_per_file)), name
        assert torch.equal(got.frames["logits"], want["logits"]) and torch.equal(got.frames["label"], want["label"])
    if variant == "ragged":
        assert [b.tolist() for b in out["boxes.mp4"].frames["boxes"].unbind()] == [[[i] * 4] * i for i in range(5)]
    stats = out.stats
    return {"in_place": stats.written_in_place, "pieces": stats.pieces, "dropped": stats.duplicates_dropped}


def _kill_mid_write() -> None:
    """From now on, this rank SIGKILLs itself halfway through writing its rows into rank 0's result.

    Large runs of rows go there by ``os.pwritev`` into rank 0's memfds (killed before the fourth
    call, three in); small ones through a mapping, by an index copy (killed with half its rows in),
    or, a dict's frames one row each, by a `torch.cat` into each run of places (killed before the
    fourth run, three in).
    """
    import signal

    real_frombuffer, real_index_copy, real_cat = torch.frombuffer, torch.Tensor.index_copy_, torch.cat
    state = {"mapped": False, "runs": 0}

    def cat(tensors, *args, out=None, **kwargs):
        if state["mapped"] and out is not None:  # a run of rows into the mapping: the fourth never lands
            state["runs"] += 1
            if state["runs"] == 4:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_cat(tensors, *args, out=out, **kwargs)

    def frombuffer(*args, **kwargs):
        state["mapped"] = True
        return real_frombuffer(*args, **kwargs)

    def index_copy_(self, dim, index, source):
        if state["mapped"] and index.numel() > 1:
            half = index.numel() // 2
            real_index_copy(self, dim, index[:half], source[:half])  # half the rows are in rank 0's memory
            os.kill(os.getpid(), signal.SIGKILL)
        return real_index_copy(self, dim, index, source)

    real_pwritev = os.pwritev

    def pwritev(fd, buffers, offset, *args):
        state["runs"] += 1
        if state["runs"] == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_pwritev(fd, buffers, offset, *args)

    torch.frombuffer, torch.Tensor.index_copy_, torch.cat, os.pwritev = frombuffer, index_copy_, cat, pwritev


def case_sender_killed_mid_write(env: dict, frames_per_file: int = 30) -> dict | None:
    """Rank 1 dies while it writes its rows into rank 0's result; rank 0 keeps ranks 0 and 2's frames."""
    os.environ.update(env)
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [f"v{k}.mp4" for k in range(4)]
    mine = {}
    for name in names:
        idx = torch.arange(rank, frames_per_file, world)
        mine[name] = list(zip(idx.tolist(), expected(name, idx, BIG)["logits"], strict=True))
    if rank == 1:
        _kill_mid_write()
    try:
        tdgather.gather(mine, timeout=20)
    except tdgather.TdgatherError as e:
        if rank:
            return {"type": type(e).__name__}
        got = e.received
        kept = {name: got[name].frame_idx.tolist() for name in got}
        for name in names:
            assert torch.equal(got[name].frames, expected(name, torch.tensor(kept[name]), BIG)["logits"]), name
        stats = got.stats
        per_rank = [stats.frames_per_rank[r] for r in range(world)]
        kept_bytes = stats.bytes == stats.frames * math.prod(BIG) * 4
        return {"type": type(e).__name__, "rank": e.rank, "kept": kept, "per_rank": per_rank}, kept_bytes
    return {"type": None}


def case_collections_while_sending(env: dict) -> dict:
    """A sender with the cyclic collector set off by every allocation: do collections run in its work?

    Returns, per rank, how many collections started inside tdgather's work of a send (a frame of
    ``tdgather/comm`` or ``tdgather/core`` on the stack below one of ``tdgather/api/send.py``:
    packing, writing in place, waiting for rank dst), and whether the collector is on after.
    """
    import gc
    import sys

    os.environ.update(env)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {f"v{k}.mp4": [(i, torch.full((25, 1000), float(i))) for i in range(rank, 60, world)] for k in range(4)}
    inside = []
    sending = os.path.join("tdgather", "api", "send.py")
    work = (os.path.join("tdgather", "comm", ""), os.path.join("tdgather", "core", ""))

    def seen(phase: str, info: dict) -> None:
        files = []
        frame = sys._getframe(1)
        while frame is not None:
            files.append(frame.f_code.co_filename)
            frame = frame.f_back
        if phase == "start" and any(f.endswith(sending) for f in files):
            if any(w in f for f in files for w in work):
                inside.append(info["generation"])

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # a collection at (nearly) every allocation
    gc.callbacks.append(seen)
    try:
        out = tdgather.gather(mine)
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
    return {"inside": len(inside), "enabled": gc.isenabled(), "in_place": out.stats.written_in_place if out else None}
