"""The methods compared, each as one call made on every rank of a gloo world.

Every method gets the same rank data: a list of inference batches ``(filenames, frame_idx,
frames[B, ...])`` from `benchmarks.workloads` (``frames`` a tensor, or for ``detection`` a dict
whose ragged leaves are jagged nested tensors ``[B, j, ...]``), and a dict view of them
``{filename: [(frame_idx, frame), ...]}`` (built before timing, each frame its own copy: a tensor,
or a dict of tensors). Each method moves every rank's frames to rank 0 and returns what rank 0
holds, so that the suite stops its clock before freeing it (freeing 629 MB of received pages costs
30-90 ms here, and is not part of receiving them). Packing (building a TensorDict, padding) is
inside the timed call, as it is for tdgather.

- ``raw_p2p``: the physical limit of this transport: each rank sends one pre-sized uint8 buffer
  of its frame bytes with ``send``; rank 0 posts one ``irecv`` per peer into fresh buffers. No packing.
- ``raw_p2p_warm``: the same into buffers rank 0 reuses from call to call: the wire alone, without
  the first-touch page faults of fresh memory (which ``raw_p2p`` pays, as any receiver of new data does).
- ``tdgather_gather``: `tdgather.gather` of a `FrameStore` filled before the timing (``copy=False``):
  the data path alone, as ``raw_p2p`` sends a buffer made before.
- ``tdgather_store``: `FrameStore.add` per batch (copying, the default), then `tdgather.gather`
  (its result is lazy: a file's `Frames` is built on access).
- ``tdgather_in_hand``: ``tdgather_store``, then every file's `Frames` built.
- ``tdgather_save``: ``tdgather_store``, then `tdgather.save` to disk (fsynced).
- ``tdgather_dict``: `tdgather.gather` of the dict (naming its ragged leaves, ``ragged=``).
- ``tdgather_collector``: `tdgather.Collector` (streaming, to disk): ``add`` per batch.
- ``gather_object`` / ``all_gather_object``: torch.distributed's pickling collectives, of the dict.
- ``td_remote``: tensordict's ``init_remote`` / ``from_remote_init``, one TensorDict per rank
  (jagged leaves stay jagged: tensordict sends their values and offsets).
- ``td_sorted``: ``td_remote``, then rank 0 joins each layout's rows of every rank and sorts them
  by (file, frame_idx): every file's frames in order, by hand (no per-file view, no copies dropped).
- ``td_gather_and_stack``: tensordict's ``gather_and_stack``; only when every sender holds the same
  number of frames of one fixed shape.
- ``pad_all_gather``: the torchmetrics / accelerate pattern, written inline: all-gather the sizes,
  pad each tensor to the largest, ``all_gather``, trim; rank 0 keeps what it gathered. A ragged
  leaf is first padded to the largest ``N_i`` on any rank (``all_reduce`` MAX, then
  ``to_padded_tensor``), and the file ids, frame_idx and every ``N_i`` are gathered with it.
- ``torch_save``: what many jobs do instead of gathering: every rank ``torch.save``'s its own batches to
  its own file and fsyncs it; rank 0 returns once every rank has (a barrier). It writes N files, in no
  order, pickled: nothing is gathered, sorted or merged, and a reader must load and join them all.
- ``disk_raw``: the disk's limit: rank 0 writes the same total bytes sequentially and fsyncs.
- ``disk_writeback``: the same, starting writeback of each 8 MiB block as it is written
  (``sync_file_range``), so the final fsync waits for less.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tensordict import TensorDict

import tdgather

__all__ = ["METHODS", "RankData", "skip_reason"]


@dataclass
class RankData:
    """One rank's share of a workload, and where a method may write."""

    batches: list[tuple[list[str], torch.Tensor, torch.Tensor | dict]]
    nbytes: int
    sizes: list[int]  # frame bytes per rank
    scratch: str
    as_dict: dict = field(default_factory=dict)
    collector_budget: int = 256 << 20
    last_add: float = 0.0
    calls: int = 0  # Collector runs so far: the same count on every rank, so the same path
    token: int = 0  # chosen by rank 0, the same on every rank
    written: list[str] = field(default_factory=list)  # outputs to delete after the call, untimed
    ragged: tuple[str, ...] = ()  # the frames' jagged leaves (detection): tdgather's ragged=, pad_all_gather's path

    @staticmethod
    def build(batches: list, scratch: str) -> RankData:
        nbytes = sum(_nbytes(t) for _, _, f in batches for t in (f.values() if isinstance(f, dict) else [f]))
        sizes = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        sizes[dist.get_rank()] = nbytes
        dist.all_reduce(sizes)
        token = torch.tensor([time.monotonic_ns() % (1 << 62) if dist.get_rank() == 0 else 0])
        dist.all_reduce(token)
        as_dict: dict = {}
        for names, idx, frames in batches:
            # per-frame copies: a view would make pickle serialise the whole batch's storage with each frame
            for name, i, frame in zip(names, idx.tolist(), _unbind(frames), strict=True):
                as_dict.setdefault(name, []).append((i, frame))
        first = batches[0][2] if batches else None
        ragged = tuple(k for k, v in first.items() if v.is_nested) if isinstance(first, dict) else ()
        return RankData(batches, nbytes, sizes.tolist(), scratch, as_dict, token=int(token), ragged=ragged)


def _nbytes(t: torch.Tensor) -> int:
    """A tensor's bytes; a jagged nested tensor's are its values' (no padding, no offsets)."""
    t = t.values() if t.is_nested else t
    return t.numel() * t.element_size()


def _unbind(frames: torch.Tensor | dict) -> list:
    """A batch's frames, each its own copy: a tensor, or a dict of tensors (a jagged leaf's frame is ``[N_i, ...]``)."""
    if not isinstance(frames, dict):
        return [f.clone() for f in frames]
    leaves = {k: v.unbind() for k, v in frames.items()}
    return [{k: rows[j].clone() for k, rows in leaves.items()} for j in range(len(next(iter(leaves.values()))))]


def raw_p2p(d: RankData) -> list[torch.Tensor] | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        bufs = [torch.empty(d.sizes[r], dtype=torch.uint8) for r in range(1, world)]
        works = [dist.irecv(b, src=r) for r, b in zip(range(1, world), bufs, strict=True) if b.numel()]
        for w in works:
            w.wait()
        return bufs
    if d.nbytes:
        if not hasattr(d, "_raw"):  # pre-sized once, outside the timing: this is the limit, not a method
            d._raw = torch.empty(d.nbytes, dtype=torch.uint8).fill_(1)
        dist.send(d._raw, dst=0)
    return None


def raw_p2p_warm(d: RankData) -> None:
    """raw_p2p into receive buffers reused from call to call: the wire alone, without first-touch page faults."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        if not hasattr(d, "_warm"):  # made by the warm-up call; the timed calls reuse them
            d._warm = [torch.ones(d.sizes[r], dtype=torch.uint8) for r in range(1, world)]
        works = [dist.irecv(b, src=r) for r, b in zip(range(1, world), d._warm, strict=True) if b.numel()]
        for w in works:
            w.wait()
    elif d.nbytes:
        if not hasattr(d, "_raw"):
            d._raw = torch.empty(d.nbytes, dtype=torch.uint8).fill_(1)
        dist.send(d._raw, dst=0)


def tdgather_store(d: RankData) -> tdgather.Gathered | None:
    return _gathered(d)


def tdgather_gather(d: RankData) -> tdgather.Gathered | None:
    """gather() alone: of a store filled before the timing (``copy=False``), as raw_p2p sends a buffer made before."""
    if not hasattr(d, "_store"):
        d._store = tdgather.FrameStore(copy=False)
        for names, idx, frames in d.batches:
            d._store.add(names, idx, frames)
    return tdgather.gather(d._store)


def _gathered(d: RankData):
    """tdgather_store's call: `FrameStore.add` per batch (copying), then `tdgather.gather`."""
    store = tdgather.FrameStore()
    for names, idx, frames in d.batches:
        store.add(names, idx, frames)
    return tdgather.gather(store)


def tdgather_in_hand(d: RankData) -> tdgather.Gathered | None:
    """tdgather_store, then every file's Frames built (the result is lazy: this is what access costs)."""
    result = _gathered(d)
    if result is not None:
        for name in result:
            result[name].frames  # noqa: B018 (built on access)
    return result


def tdgather_save(d: RankData) -> None:
    """tdgather_store, then `tdgather.save` of the result (written from the received buffers, fsynced)."""
    result = _gathered(d)
    if result is not None:
        d.calls += 1
        d.written.append(tdgather.save(result, os.path.join(d.scratch, f"save-{d.token}-{d.calls}")))


def tdgather_dict(d: RankData) -> tdgather.Gathered | None:
    return tdgather.gather(d.as_dict, ragged=d.ragged)


def tdgather_collector(d: RankData) -> None:
    d.calls += 1
    path = os.path.join(d.scratch, f"collector-{d.token}-{d.calls}")  # the same path on every rank
    d.written.append(path)
    with tdgather.Collector(path, memory_budget=d.collector_budget, progress=False) as col:
        for names, idx, frames in d.batches:
            col.add(names, idx, frames)
        d.last_add = time.time()


def gather_object(d: RankData) -> list | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [None] * world if rank == 0 else None
    dist.gather_object(d.as_dict, out, dst=0)
    return out


def all_gather_object(d: RankData) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, d.as_dict)
    return out


def _file_id(name: str) -> int:
    """The integer in a workload's filename (``large_00012.mp4``, ``video_0012.mp4``): files as numbers, no names."""
    return int(name.split("_")[-1].split(".")[0])


def _rank_tensordict(d: RankData) -> TensorDict:
    """One TensorDict per rank: per layout, frames (a dict's as a TensorDict), frame_idx and integer file ids."""
    groups: dict[str, list] = {}
    for names, idx, frames in d.batches:
        if isinstance(frames, dict):  # one layout: tensordict's cat joins jagged leaves as jagged
            key, frames = "dict", TensorDict(frames, batch_size=[len(names)])
        else:
            key = f"{str(frames.dtype).removeprefix('torch.')}_{'x'.join(map(str, frames.shape[1:]))}"
        groups.setdefault(key, []).append((names, idx, frames))
    out = {}
    for key, items in sorted(groups.items()):
        files = torch.tensor([_file_id(n) for names, _, _ in items for n in names])
        frames = torch.cat([f for _, _, f in items])
        out[key] = TensorDict(
            {"frames": frames, "frame_idx": torch.cat([i for _, i, _ in items]), "file": files},
            batch_size=[frames.shape[0]],
        )
    return TensorDict(out, batch_size=[])


def td_remote(d: RankData) -> list[TensorDict] | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        return [TensorDict.from_remote_init(src=src) for src in range(1, world)]
    _rank_tensordict(d).init_remote(dst=0)
    return None


def td_sorted(d: RankData) -> dict[str, TensorDict] | None:
    """``td_remote``, then rank 0 joins every rank's rows of each layout and sorts them by (file, frame_idx).

    What a user writes by hand with tensordict to hold every file's frames in order (ids per batch,
    one TensorDict a rank, one sort): the result tdgather gives, less the per-file view and the
    copies dropped.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        _rank_tensordict(d).init_remote(dst=0)
        return None
    every = [_rank_tensordict(d), *(TensorDict.from_remote_init(src=src) for src in range(1, world))]
    out = {}
    for key in sorted({k for td in every for k in td.keys()}):
        rows = torch.cat([td[key] for td in every if key in td.keys()])
        order = torch.argsort(rows["file"] * (int(rows["frame_idx"].max()) + 1) + rows["frame_idx"], stable=True)
        out[key] = rows[order]
    return out


def td_gather_and_stack(d: RankData) -> TensorDict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    _, _, frames = d.batches[0] if d.batches else (None, None, None)
    if rank == 0:
        n = d.sizes[1] // (frames[0].numel() * frames.element_size())
        rows = TensorDict(
            {
                "frames": torch.empty((world - 1, n, *frames.shape[1:]), dtype=frames.dtype),
                "frame_idx": torch.empty((world - 1, n), dtype=torch.int64),
            },
            batch_size=[world - 1, n],
        )
        rows.gather_and_stack(dst=0)
        return rows
    td = TensorDict(
        {"frames": torch.cat([f for _, _, f in d.batches]), "frame_idx": torch.cat([i for _, i, _ in d.batches])},
        batch_size=[sum(i.numel() for _, i, _ in d.batches)],
    )
    td.gather_and_stack(dst=0)
    return None


def pad_all_gather(d: RankData) -> dict[object, list[torch.Tensor]]:
    """torchmetrics' gather_all_tensors / accelerate's pad_across_processes + gather, per column.

    Returns ``{column: [each rank's rows]}``, which every rank holds (as ``all_gather`` gives).
    """
    columns = _ragged_columns(d) if d.ragged else _layout_columns(d)
    return {key: _all_gather_padded(t) for key, t in columns}


def _layout_columns(d: RankData) -> Iterator[tuple[object, torch.Tensor]]:
    """Per layout on any rank, ``((dtype, shape, "frames"), frames)`` and ``((dtype, shape, "frame_idx"), idx)``."""
    layouts: dict[tuple, list] = {}
    for _, idx, frames in d.batches:
        layouts.setdefault((frames.dtype, tuple(frames.shape[1:])), []).append((idx, frames))
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, sorted(layouts, key=str))  # which layouts exist anywhere (tiny)
    for dtype, shape in sorted({k for ks in keys for k in ks}, key=str):
        items = layouts.get((dtype, shape), [])
        frames = torch.cat([f for _, f in items]) if items else torch.empty((0, *shape), dtype=dtype)
        idx = torch.cat([i for i, _ in items]) if items else torch.empty(0, dtype=torch.int64)
        yield (dtype, shape, "frames"), frames
        yield (dtype, shape, "frame_idx"), idx


def _ragged_columns(d: RankData) -> Iterator[tuple[str, torch.Tensor]]:
    """Every leaf, a ragged one padded to the largest ``N_i`` on any rank, then ``"ids"``: int64 rows of (file id,
    frame_idx, ``N_i`` of each ragged leaf in ``d.ragged``'s order). Every rank must hold frames."""
    lengths = [torch.cat([v[k].offsets().diff() for _, _, v in d.batches]) for k in d.ragged]
    most = torch.stack([n.max() for n in lengths])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the largest N_i anywhere, per ragged leaf
    for k in d.batches[0][2]:
        if k in d.ragged:
            width = int(most[d.ragged.index(k)])
            pad = [
                torch.nested.to_padded_tensor(v[k], 0, output_size=(len(names), width, *v[k].shape[2:]))
                for names, _, v in d.batches
            ]
            yield k, torch.cat(pad)
        else:
            yield k, torch.cat([v[k] for _, _, v in d.batches])
    files = torch.tensor([_file_id(n) for names, _, _ in d.batches for n in names])
    yield "ids", torch.stack([files, torch.cat([i for _, i, _ in d.batches]), *lengths], 1)


def _all_gather_padded(t: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's ``t`` (its first dims may differ): sizes gathered, padded to the largest, all_gather, trimmed."""
    world = dist.get_world_size()
    size = torch.tensor([t.shape[0]])
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)  # 1. sizes
    most = int(max(s.item() for s in sizes))
    padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype)  # 2. pad to the largest
    padded[: t.shape[0]] = t
    row = math.prod(t.shape[1:]) * t.element_size()
    padded = padded.reshape(-1).view(torch.uint8).view(most, row)  # gloo takes no bf16/bool: bytes
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)  # 3. gather
    return [o[: int(s)].view(t.dtype).view(int(s), *t.shape[1:]) for o, s in zip(out, sizes, strict=True)]  # 4. trim


def torch_save(d: RankData) -> None:
    """Every rank ``torch.save``'s its own batches to its own file and fsyncs it; rank 0 returns once all N are."""
    d.calls += 1
    folder = os.path.join(d.scratch, f"torch_save-{d.token}-{d.calls}")  # the same folder on every rank
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank{dist.get_rank()}.pt"), "wb") as fh:
        torch.save(d.batches, fh)
        fh.flush()
        os.fsync(fh.fileno())
    if dist.get_rank() == 0:
        d.written.append(folder)
    dist.barrier()  # rank 0's clock stops when the last rank's file is on disk


def disk_raw(d: RankData) -> None:
    if dist.get_rank() != 0:
        return
    total = sum(d.sizes)
    if not hasattr(d, "_block"):
        d._block = torch.ones(8 << 20, dtype=torch.uint8).numpy()
    path = os.path.join(d.scratch, f"raw-{time.monotonic_ns()}")
    with open(path, "wb") as fh:
        left = total
        while left > 0:
            n = min(left, d._block.size)
            fh.write(memoryview(d._block)[:n])
            left -= n
        fh.flush()
        os.fsync(fh.fileno())
    os.unlink(path)


def disk_writeback(d: RankData) -> None:
    """disk_raw, starting writeback of each 8 MiB block as it is written (sync_file_range), then fsync."""
    if dist.get_rank() != 0:
        return
    if not hasattr(d, "_block"):
        d._block = torch.ones(8 << 20, dtype=torch.uint8).numpy()
    start_writeback = _sync_file_range()
    path = os.path.join(d.scratch, f"raw-{time.monotonic_ns()}")
    with open(path, "wb") as fh:
        left, offset = sum(d.sizes), 0
        while left > 0:
            n = min(left, d._block.size)
            fh.write(memoryview(d._block)[:n])
            if start_writeback:
                fh.flush()
                start_writeback(fh.fileno(), offset, n)
            offset, left = offset + n, left - n
        fh.flush()
        os.fsync(fh.fileno())
    os.unlink(path)


def _sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE): start writeback, do not wait; else None."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, n: fn(fd, offset, n, 2)


METHODS: dict[str, Callable[[RankData], object]] = {
    "raw_p2p": raw_p2p,
    "raw_p2p_warm": raw_p2p_warm,
    "tdgather_gather": tdgather_gather,
    "tdgather_store": tdgather_store,
    "tdgather_in_hand": tdgather_in_hand,
    "tdgather_save": tdgather_save,
    "tdgather_dict": tdgather_dict,
    "tdgather_collector": tdgather_collector,
    "gather_object": gather_object,
    "all_gather_object": all_gather_object,
    "td_remote": td_remote,
    "td_sorted": td_sorted,
    "td_gather_and_stack": td_gather_and_stack,
    "pad_all_gather": pad_all_gather,
    "torch_save": torch_save,
    "disk_raw": disk_raw,
    "disk_writeback": disk_writeback,
}


def skip_reason(method: str, workload: str) -> str | None:
    """Why a method does not run on a workload, for the report; None where it runs."""
    if method == "td_gather_and_stack" and workload not in ("large", "large_whole", "tiny"):
        return "gather_and_stack needs every sender to hold the same number of frames of one fixed shape"
    return None
