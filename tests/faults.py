"""Per-rank cases that inject the faults of the fault matrix (docs/design.md) into real gloo worlds.

Each ``case_*`` runs in every rank of `tdgather.tools.launch.run_local_world`. Ranks that are
killed or stopped leave no result; the survivors return what they saw (error type, rank,
message, and wall-clock times, so the tests can bound the time to error).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tdgather
from tdgather.comm.pack import pack
from tdgather.comm.transport import Channel
from tdgather.comm.wire import MAGIC, PRELUDE_LEN, VERSION, Kind, encode_json

from .cases import value

B = 8  # frames per batch
SHAPE = (3, 32)
BATCHES = {0: 3, 1: 10, 2: 6}  # per rank, in the three-rank worlds
LONG_STEP = 8.0  # seconds


def batch(rank: int, b: int, ragged: bool = False) -> tuple[list[str], list[int], Any]:
    """Batch ``b`` of ``rank``: one filename, B frames; ``ragged``: beside them 0-4 boxes per frame."""
    name = f"r{rank}_b{b:03d}.mp4"
    frames = torch.stack([value(name, i, SHAPE) for i in range(B)])
    if not ragged:
        return [name] * B, list(range(B)), frames
    boxes = [value(name, 100 + i, (4 * ((i + b + rank) % 5),)).view(-1, 4) for i in range(B)]
    return [name] * B, list(range(B)), {"x": frames, "boxes": torch.nested.as_nested_tensor(boxes, layout=torch.jagged)}


def same_frames(got: Any, want: Any) -> bool:
    """Bit-exact equality of a batch's frames: a tensor, or ``{"x": tensor, "boxes": nested tensor}``."""
    if isinstance(want, torch.Tensor):
        return torch.equal(got, want)
    boxes, want_boxes = got["boxes"], want["boxes"]
    return (
        torch.equal(got["x"], want["x"])
        and torch.equal(boxes.offsets(), want_boxes.offsets())
        and torch.equal(boxes.values(), want_boxes.values())
    )


def as_dict(rank: int, batches: int) -> dict:
    """The first ``batches`` batches of ``rank`` as ``{filename: [(frame_idx, value), ...]}``."""
    out = {}
    for b in range(batches):
        names, idx, frames = batch(rank, b)
        out[names[0]] = [(i, frames[i]) for i in idx]
    return out


def _error(e: BaseException, **extra) -> dict:
    return {"type": type(e).__name__, "rank": getattr(e, "rank", None), "message": str(e), **extra}


def _wait_until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"test harness: {what} did not happen within {timeout} s")
        time.sleep(0.01)


def _stamp(tmp: str, name: str) -> None:
    Path(tmp, f"{name}.json").write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))


def _read_stamp(tmp: str, name: str) -> dict:
    return json.loads(Path(tmp, f"{name}.json").read_text())


def _kill_between_header_and_payload(on_message: int, tmp: str) -> None:
    """From now on, this rank SIGKILLs itself after the header of its ``on_message``-th data payload message."""
    real = dist.isend
    state = {"data": 0, "armed": 0}

    def isend(t, group=None, group_dst=None):
        if t.dtype == torch.int64 and t.numel() == PRELUDE_LEN and int(t[0]) == MAGIC:
            if int(t[2]) == Kind.DATA and int(t[5]) > 0:
                state["data"] += 1
                state["armed"] = state["data"] == on_message
        elif state["armed"] and t.dtype == torch.uint8:
            state["armed"] += 1
            if state["armed"] == 3:  # the header was posted; this is the payload
                time.sleep(0.5)  # let rank 0 read the header
                _stamp(tmp, "fault")
                os.kill(os.getpid(), signal.SIGKILL)
        return real(t, group=group, group_dst=group_dst)

    dist.isend = isend


# ---- rows 1-3: a rank fails in the middle of a Collector stream --------------------------------


def case_stream_fault(out: str, how: str, k: int, tmp: str, timeout: float, ragged: bool = False) -> dict | None:
    """Rank 1 fails (``how``: raise, kill, stop) after k batches reached rank 0; rank 2 sent all first.

    Rank 0 waits until it holds rank 1's k batches and every batch of rank 2, then lets rank 1 fail,
    so what must be saved is known exactly.
    """
    rank = dist.get_rank()
    go = Path(tmp, "go")
    if rank == 1 and how == "kill":
        _kill_between_header_and_payload(k + 1, tmp)
    try:
        with tdgather.Collector(out, chunk_bytes=1, timeout=timeout, progress=False) as col:
            for b in range(BATCHES[rank]):
                if rank == 1 and b == k:
                    _wait_until(go.exists, "rank 0's go")
                    if how == "raise":
                        _stamp(tmp, "fault")
                        raise RuntimeError(f"boom after {k} batches")
                    if how == "stop":
                        _stamp(tmp, "fault")
                        os.kill(os.getpid(), signal.SIGSTOP)
                col.add(*batch(rank, b, ragged))
            if rank == 0:
                want = {1: k * B, 2: BATCHES[2] * B}
                _wait_until(lambda: all(col.status().frames_received[r] == n for r, n in want.items()), "the frames")
                go.touch()
            if rank == 2 and how == "raise":
                time.sleep(LONG_STEP)  # a long inference step: rank 0 must not wait for its next add()
                col.add(*batch(rank, BATCHES[rank], ragged))
    except Exception as e:
        seen = time.time()
        if rank == 0 and how == "stop":
            os.kill(_read_stamp(tmp, "fault")["pid"], signal.SIGKILL)  # what torchrun would do
        return _error(e, seen=seen)
    return {"type": None}


# ---- row 22: a rank's loop hangs while its process lives; slow loops that progress -----------------


def _hang_forever() -> None:
    """What a deadlocked DataLoader worker or a stuck read looks like: the thread blocks, the process lives."""
    threading.Event().wait()


def case_hung_loop(out: str, hung: int, tmp: str, timeout: float) -> dict | None:
    """Rank ``hung`` blocks for ever in its third batch; every other rank must raise, naming it.

    The others finish their loops and wait in close (rank 0 too, unless it is the hung one). The
    first rank to raise SIGKILLs the hung one, as torchrun would once a rank exits with an error.
    """
    rank = dist.get_rank()
    try:
        with tdgather.Collector(out, chunk_bytes=1, timeout=timeout, progress=False) as col:
            for b in range(BATCHES[rank]):
                if rank == hung and b == 2:
                    _stamp(tmp, "fault")
                    _hang_forever()
                col.add(*batch(rank, b))
    except Exception as e:
        seen = time.time()
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.kill(_read_stamp(tmp, "fault")["pid"], signal.SIGKILL)
        return _error(e, seen=seen)
    return {"type": None}


def case_slow_loop(out: str, timeout: float, step: float) -> dict | None:
    """Every batch of rank 1 takes ``step`` seconds (under the timeout), far longer in all than the timeout."""
    rank = dist.get_rank()
    with tdgather.Collector(out, timeout=timeout, progress=False) as col:
        for b in range(BATCHES[rank]):
            if rank == 1:
                time.sleep(step)  # a slow batch: no call into tdgather meanwhile
            col.add(*batch(rank, b))
    return {"frames": col.summary.frames if col.summary is not None else None}


# ---- rows 1-3 for gather(): a rank fails before or while sending --------------------------------


def case_gather_fault(how: str, tmp: str, timeout: float) -> dict | None:
    """Rank 1 gives bad input (``raise``), is killed before sending (``kill``), or stops (``stop``)."""
    rank = dist.get_rank()
    preds = as_dict(rank, BATCHES[rank])
    if rank == 1:
        _stamp(tmp, "fault")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        preds["bad.mp4"] = (0, torch.zeros(2, dtype=torch.complex128))
    start = time.time()
    try:
        tdgather.gather(preds, timeout=timeout)
    except tdgather.TdgatherError as e:
        seen = time.time()
        if rank == 0 and how == "stop":
            os.kill(_read_stamp(tmp, "fault")["pid"], signal.SIGKILL)
        received = None
        if e.received is not None:
            received = {"per_rank": {str(r): n for r, n in e.received.stats.frames_per_rank.items()}}
            for r in (0, 2):  # every frame of the healthy ranks is there, bit for bit
                for name, pairs in as_dict(r, BATCHES[r]).items():
                    got = e.received[name]
                    assert got.frame_idx.tolist() == [i for i, _ in pairs], name
                    assert torch.equal(got.frames, torch.stack([v for _, v in pairs])), name
        return _error(e, seen=seen, start=start, received=received)
    return {"type": None}


# ---- row 4: senders exit right after finishing ------------------------------------------------


def case_exit_after_finishing(out: str, streaming: bool) -> dict | None:
    """Senders return from gather() or close() and exit at once, without destroying the group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    preds = as_dict(rank, BATCHES[rank % 3])
    if streaming:
        with tdgather.Collector(out, chunk_bytes=1, timeout=30, progress=False) as col:
            col.update(preds)
        result = tdgather.open(out) if rank == 0 else None
    else:
        result = tdgather.gather(preds, timeout=30)
    if rank != 0:
        os._exit(0)
    expected = {}
    for r in range(world):
        expected.update(as_dict(r, BATCHES[r % 3]))
    assert sorted(result) == sorted(expected)
    for name, pairs in expected.items():
        assert torch.equal(result[name].frames, torch.stack([v for _, v in pairs])), name
    return {"frames": sum(len(p) for p in expected.values())}


# ---- rows 5-8: hand-made messages from real peers ---------------------------------------------


class MakesAFile:
    """Unpickling this creates the file: proof, if it ever exists, that a peer's bytes ran as code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _valid_data() -> tuple[dict, torch.Tensor]:
    """A valid data message of 4 frames (its pieces are never sent: rank 0 stops at the data message)."""
    store = tdgather.FrameStore()
    store.add(["x.mp4"] * 4, [0, 1, 2, 3], torch.ones(4, 1 << 16))
    packed = pack(store)
    return packed.header, packed.index


def corrupted(name: str, rank: int, evidence: str) -> tuple[list[int], bytes, torch.Tensor | None]:
    """A hand-made message: (prelude fields, header bytes, payload)."""
    header, payload = _valid_data()
    group = header["groups"][0]
    prelude = [MAGIC, VERSION, int(Kind.DATA), 0, 0, payload.numel(), rank, 0, 0, 0]  # call (0, 0, 0)
    raw = None
    if name == "magic":
        prelude[0] = 0x12345678
    elif name == "version":
        prelude[1] = VERSION + 1
    elif name == "header_len":
        prelude[4] = 1 << 40  # a terabyte header
    elif name == "payload_len":
        prelude[5] = 1 << 50
    elif name == "non_utf8":
        raw = b'{"files": "\xff\xfe"}'
    elif name == "nan":
        raw = b'{"files": [NaN]}'
    elif name == "duplicate_keys":
        raw = b'{"files": [], "files": []}'
    elif name == "deep":
        raw = b"[" * 10_000 + b"]" * 10_000
    elif name == "pieces":
        group["pieces"][0] = [1 << 40]  # rows that are not the group's: a terabyte piece
    elif name == "runs":
        group["runs"] = group["rows"] + 1  # more runs than rows
    elif name == "index":
        prelude[5] += 64  # more payload than the frame index the groups announce
    elif name == "dtype":
        group["layout"]["leaves"][0]["dtype"] = "complex128"
    elif name == "file_ids":
        payload[64 : 64 + 8].view(torch.int64).fill_(7)  # a run naming file 7 of 1
    elif name == "pickle":
        raw = pickle.dumps(MakesAFile(evidence))
    if raw is None:
        raw = encode_json(header)
    if prelude[4] == 0:
        prelude[4] = len(raw)
    if prelude[5] != payload.numel() and prelude[5] < 1 << 20:
        payload = torch.cat([payload, torch.zeros(prelude[5] - payload.numel(), dtype=torch.uint8)])
    return prelude, raw, payload


def case_corrupted_peers(names: list[str], evidence: str) -> dict | None:
    """Peer r sends ``names[r - 1]``; rank 0 receives each, recording what was allocated."""
    rank = dist.get_rank()
    if rank != 0:
        prelude, raw, payload = corrupted(names[rank - 1], rank, evidence)
        tensors = [torch.tensor(prelude, dtype=torch.int64), torch.frombuffer(bytearray(raw), dtype=torch.uint8)]
        works = [dist.isend(t, group_dst=0) for t in [*tensors, payload]]  # noqa: F841 (kept alive, never waited)
        Channel(dist.group.WORLD, 0, timedelta(seconds=60)).recv()  # stay until rank 0 has read what it wanted
        return None
    allocated: list[int] = []
    real_empty = torch.empty

    def empty(*size, **kw):
        t = real_empty(*size, **kw)
        allocated.append(t.numel() * t.element_size())
        return t

    out = {}
    torch.empty = empty
    try:
        for peer, name in enumerate(names, start=1):
            allocated.clear()
            try:
                Channel(dist.group.WORLD, peer, timedelta(seconds=60)).recv()
                out[name] = {"type": None}
            except tdgather.TdgatherError as e:
                out[name] = _error(e, field=getattr(e, "field", None), largest_allocation=max(allocated))
    finally:
        torch.empty = real_empty
    for peer in range(1, len(names) + 1):
        ch = Channel(dist.group.WORLD, peer, timedelta(seconds=60))
        ch.wait(ch.send(Kind.DONE, {"frames": 0}))
    return out


def case_pickle_as_data(evidence: str) -> dict | None:
    """A pickle that creates a file when unpickled, sent as tensor bytes and as a JSON string."""
    rank = dist.get_rank()
    blob = pickle.dumps(MakesAFile(evidence))
    preds = {}
    if rank == 1:
        preds["payload.bin"] = (0, torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        preds["meta.json"] = (0, {"x": torch.zeros(1), "note": blob.decode("latin-1")})
    result = tdgather.gather(preds, timeout=30)
    if rank != 0:
        return None
    assert bytes(result["payload.bin"].frames[0].tolist()) == blob  # bytes are data
    assert result["meta.json"].frames["note"] == [blob.decode("latin-1")]
    return {"files": sorted(result)}


# ---- rows 14 and 17: output errors, millions of tiny frames ------------------------------------


def case_disk_full(out: str) -> dict:
    """Rank 0's file size limit drops below a shard's size after two shards were committed."""
    import resource

    rank = dist.get_rank()
    try:
        with tdgather.Collector(out, chunk_bytes=1, memory_budget=1 << 20, timeout=30, progress=False) as col:
            if rank == 0:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so write() fails with EFBIG, as on a full disk
                _wait_until(lambda: col.status().shards >= 2, "two shards")
                soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, hard))
            else:
                for b in range(400):
                    col.add(*batch(rank, b))
    except tdgather.TdgatherError as e:
        return _error(e)
    return {"type": None}


def case_output_refused(out: str) -> dict:
    """The output cannot be created: every rank raises in open(), before any frame moves."""
    try:
        with tdgather.Collector(out, timeout=30, progress=False) as col:
            col.add(*batch(dist.get_rank(), 0))
    except tdgather.TdgatherError as e:
        return _error(e)
    return {"type": None}


def case_many_tiny_frames(out: str, frames_per_sender: int, budget: int) -> dict | None:
    """Millions of 16-byte frames through a Collector under a small budget; header sizes recorded."""
    from benchmarks.memory import PeakSampler

    rank = dist.get_rank()
    headers: list[int] = []
    if rank == 0:
        real_recv = Channel.recv

        def recv(self, first_wait=None):
            msg = real_recv(self, first_wait)
            headers.append(msg.prelude.header_len)
            return msg

        Channel.recv = recv
    sampler = PeakSampler() if rank == 0 else None
    step = 8000
    with tdgather.Collector(out, memory_budget=budget, timeout=60, progress=False) as col:
        if rank != 0:
            for start in range(0, frames_per_sender, step):
                idx = torch.arange(start, start + step)
                names = [f"r{rank}_clip{i // 1000:05d}.mp4" for i in range(start, start + step)]
                col.add(names, idx % 1000, torch.full((step, 4), float(rank)))
    if rank != 0:
        return None
    peak = sampler.close()
    return {"anon": peak["RssAnon"], "frames": col.summary.frames, "max_header": max(headers)}


# ---- row 15: rank 0 killed while it writes -----------------------------------------------------


def dataset(kind: str) -> dict:
    """The old dataset (one file) or the new one (three shards' worth) of the kill-while-writing row."""
    if kind == "old":
        return {"old.mp4": [(0, value("old.mp4", 0, SHAPE))]}
    return {f"new_{i}.mp4": [(j, value(f"new_{i}.mp4", j, SHAPE)) for j in range(40)] for i in range(6)}


def case_write_and_die(target: str, event: str, count: int) -> dict:
    """Save the new dataset over ``target``; SIGKILL this process at the ``count``-th ``event``.

    Events: ``write`` (after a chunk of a file is written), ``fsync`` (before an fsync of a file or
    directory), ``replace`` (after a rename into place), ``exchange`` (after the atomic swap).
    """
    from tdgather.storage.atomic import LocalFS
    from tdgather.storage.writer import DatasetWriter

    seen = {"n": 0}

    def tick(kind: str) -> None:
        if kind == event:
            seen["n"] += 1
            if seen["n"] == count:
                os.kill(os.getpid(), signal.SIGKILL)

    class Dying(LocalFS):  # the sink's own steps, through its filesystem seam
        def exchange(self, a, b):
            swapped = super().exchange(a, b)
            tick("exchange")
            return swapped

        def write_all(self, fd, chunks):
            def counted():
                for chunk in chunks:
                    yield chunk
                    tick("write")

            super().write_all(fd, counted())

    real_fsync, real_replace = os.fsync, os.replace  # every fsync and rename, the directories' too: os-level

    def fsync(fd):
        tick("fsync")
        return real_fsync(fd)

    def replace(a, b):
        real_replace(a, b)
        tick("replace")

    os.fsync, os.replace = fsync, replace
    try:
        tdgather.save(
            tdgather.gather(dataset("new")),
            target,
            overwrite=True,
            max_shard_bytes=12_000,
            sink=lambda path, **kw: DatasetWriter(path, fs=Dying(), **kw),
        )
    finally:
        os.fsync, os.replace = real_fsync, real_replace
    return {"events": seen["n"]}


# ---- row 33: rank dst SIGKILLed hours into a job with small outputs --------------------------------


def case_small_outputs_then_dst_killed(out: str, tmp: str, commit_every: float) -> dict | None:
    """2 ranks add 1 KB frames every 50 ms for 6 s; rank 0 is SIGKILLed at 5 s. Each rank logs its adds."""
    rank = dist.get_rank()
    added, log = 0, []
    err = os.open(Path(tmp, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)  # stderr is a file, as in a SLURM or Kubernetes job's log
    try:
        with tdgather.Collector(out, commit_every=commit_every, timeout=30) as col:  # progress: log lines
            for b in range(120):
                n = 4
                col.add([f"r{rank}.mp4"] * n, list(range(added, added + n)), torch.full((n, 256), float(b)))
                added += n
                log.append([time.time(), added])
                if rank == 0 and b == 100:
                    received = col.status().frames_received
                    Path(tmp, "rank0.json").write_text(json.dumps({"received": received, "log": log}))
                    _stamp(tmp, "fault")
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.05)
    except tdgather.TdgatherError as e:
        return _error(e, log=log)
    return {"type": None}
