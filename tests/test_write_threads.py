"""Shards written on several threads (`DatasetWriter(write_threads=k)`, `Collector(write_threads=k)`).

The dataset must be the one a single thread writes, byte for byte; a buffer a shard is written from is
never reused before that write ends; a write that fails on its thread fails the run, and the
shards written before it stay listed in the incomplete record.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import tdgather
from tdgather.errors import OutputError
from tdgather.storage.atomic import LocalFS
from tdgather.storage.writer import DatasetWriter
from tdgather.tools.launch import WorldError, run_local_world

from . import write_threads_cases as wc


def preds(lo: int, hi: int) -> dict[str, list]:
    """Filenames ``lo..hi-1``, three frames of 4 KiB each, values from the name."""
    return {f"v{i:03d}.mp4": [(t, torch.full((1024,), float(i * 10 + t))) for t in range(3)] for i in range(lo, hi)}


def write(path: Path, threads: int, fs: LocalFS | None = None) -> DatasetWriter:
    w = DatasetWriter(path, write_threads=threads, max_shard_bytes=40 << 10, **({"fs": fs} if fs else {}))
    for lo in range(0, 60, 20):  # three calls, several shards each
        w.write(tdgather.gather(preds(lo, lo + 20)))
    return w


def drop(entry: dict, key: str) -> dict:
    return {k: v for k, v in entry.items() if k != key}


def index(path: Path) -> dict:
    return json.loads((path / "tdgather.index.json").read_text())


def test_threads_write_the_dataset_one_thread_writes(tmp_path):
    for threads in (1, 3):
        write(tmp_path / f"t{threads}", threads).commit()
    one, three = index(tmp_path / "t1"), index(tmp_path / "t3")
    assert len(one["shards"]) >= 9  # several shards a call: they were written at once
    # names, frames, bytes, groups and size of each shard; their records name each run, so the CRC-32s differ
    assert {k: drop(e, "crc32") for k, e in three["shards"].items()} == {
        k: drop(e, "crc32") for k, e in one["shards"].items()
    }
    assert three["files"] == one["files"]
    for shard, entry in three["shards"].items():
        assert zlib.crc32((tmp_path / "t3" / shard).read_bytes()) == entry["crc32"], shard
        with safe_open(str(tmp_path / "t3" / shard), "pt") as a, safe_open(str(tmp_path / "t1" / shard), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())  # noqa: SIM118
    ds = tdgather.open(tmp_path / "t3")
    assert len(ds) == 60 and torch.equal(ds["v042.mp4"].frames[2], torch.full((1024,), 422.0))


def test_threads_upload_to_an_object_store_what_they_write_locally(tmp_path, s3, url):
    w = DatasetWriter(url, storage_options=s3, write_threads=3, max_shard_bytes=40 << 10)
    for lo in range(0, 60, 20):
        w.write(tdgather.gather(preds(lo, lo + 20)))
    w.commit()
    write(tmp_path / "t1", 1).commit()
    a, b = tdgather.open(url, storage_options=s3), tdgather.open(tmp_path / "t1")
    assert sorted(a) == sorted(b) and len(b) == 60 and len(a.index["shards"]) == len(b.index["shards"])
    for name in b:
        assert torch.equal(a[name].frame_idx, b[name].frame_idx) and torch.equal(a[name].frames, b[name].frames)
    assert all("sha256" in entry for entry in a.index["shards"].values())


class FailsOneShard(LocalFS):
    """A disk whose write of shard number ``bad`` fails, on whichever thread writes it."""

    def __init__(self, bad: str) -> None:
        self.bad = bad

    def write_atomic(self, path, chunks, then=None):
        if self.bad in path.name:
            raise OutputError(f"writing {path.name!r} failed (no space left on device)")
        super().write_atomic(path, chunks, then)


def test_a_write_that_fails_on_its_thread_fails_the_run_and_keeps_what_was_written(tmp_path):
    w = DatasetWriter(tmp_path / "ds", write_threads=3, max_shard_bytes=40 << 10, fs=FailsOneShard("00004"))
    with pytest.raises(OutputError, match="00004.*no space left"):
        for lo in range(0, 60, 20):  # raised at the write that finds it failed, or at the wait below
            w.write(tdgather.gather(preds(lo, lo + 20)))
        w.wait_written()
    where = Path(w.abort(OutputError("disk full")))
    record = json.loads((where / "tdgather.incomplete.json").read_text())
    assert record["shards"] and not any("00004" in s for s in record["shards"])
    assert not any("00004" in p.name for p in where.iterdir())
    for shard, entry in record["shards"].items():  # each listed shard is whole, with its size and checksum
        assert (where / shard).stat().st_size == entry["size"] and "crc32" in entry
    ds = tdgather.open(where, incomplete=True)
    kept = [name for name in ds]
    assert kept and len(kept) < 60
    for name in kept:
        i = int(name[1:4])
        assert torch.equal(ds[name].frames[:, 0], torch.tensor([i * 10.0, i * 10 + 1, i * 10 + 2])), name


@pytest.mark.world
@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_a_collector_writing_on_threads_from_a_slow_disk_keeps_every_frame(tmp_path, shm):
    got = run_local_world(wc.case_threads, 3, str(tmp_path / "threads"), 3, shm, True, timeout=180)
    want = run_local_world(wc.case_threads, 3, str(tmp_path / "one"), 1, shm, False, timeout=180)
    assert got[1:] == [None, None] and got[0]["frames"] == want[0]["frames"] == 3 * 480
    assert got[0]["shards"] > 6  # many shards, some written while the next chunks arrived
    assert (got[0]["shared"] > 0) == shm
    a, b = tdgather.open(tmp_path / "threads"), tdgather.open(tmp_path / "one")
    assert sorted(a) == sorted(b) and len(b) == 6
    for name in b:  # bit for bit: a buffer reused while its shard was written would show here
        assert torch.equal(a[name].frame_idx, b[name].frame_idx), name
        assert torch.equal(a[name].frames, b[name].frames), name


@pytest.mark.world
def test_rank_dst_killed_while_threads_write_then_resumed_keeps_every_frame_once(tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(WorldError) as e:
        run_local_world(wc.case_threads, 3, str(out), 3, True, True, 5, timeout=180)
    assert e.value.failures[0] == "exited with code -9 and no result", e.value.failures
    partial = tmp_path / "ds.partial"
    names = sorted(p.name for p in partial.iterdir())
    assert any(".tmp-" in n for n in names)  # the shard it was killed writing, at least
    saved = sum(1 for n in names if n.startswith("shard-"))
    assert saved >= 3  # the shards written before it (and beside it, on the other threads)
    got = run_local_world(wc.case_threads, 3, str(out), 3, True, False, 0, True, timeout=180)
    want = run_local_world(wc.case_threads, 3, str(tmp_path / "one"), 1, True, False, timeout=180)
    assert got[0]["frames"] == want[0]["frames"] == 3 * 480
    a, b = tdgather.open(out), tdgather.open(tmp_path / "one")
    assert sorted(a) == sorted(b) and not partial.exists()
    for name in b:  # every frame once, bit for bit
        assert torch.equal(a[name].frame_idx, b[name].frame_idx), name
        assert torch.equal(a[name].frames, b[name].frames), name
    first = a.metadata["attempts"][0]
    assert first["failure"]["type"] == "Unrecorded" and first["frames"] > 0


@pytest.mark.parametrize("bad", [0, -1, 65, 1.5, True, "2"])
def test_write_threads_must_be_a_count(tmp_path, bad):
    with pytest.raises(ValueError, match=rf"write_threads: expected None or an integer from 1 to 64, got {bad!r}"):
        tdgather.Collector(tmp_path / "ds", write_threads=bad)
