"""What every `tdgather.storage.store.Store` must do: one suite, run against each store.

`StoreTests` asks for a ``store`` fixture (an empty store, ready to write) and checks the
protocol as the writers and readers rely on it: bytes in and out, whole-or-nothing puts, byte
ranges of a file as it was opened, conditional puts (racing ones too, where the store says its
condition is its own), checksums as its ``checksum`` flag says, and a safetensors file written
by the codec and read back through ``open``. tests/test_store_conformance.py binds it to the local
directory, ``memory://`` and S3 on a moto server; a new store is one class there.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import threading
import zlib

import pytest
import torch

import tdgather
from tdgather.errors import DatasetError, OutputError
from tdgather.format.codec import SafetensorsFile, encode
from tdgather.storage.reader import Dataset
from tdgather.storage.store import digest
from tdgather.storage.writer import DatasetWriter

DATA = bytes(range(256)) * 40  # 10,240 bytes


class Boom(Exception):
    """A source of bytes that failed."""


def failing(chunks: list):
    yield from chunks
    raise Boom("the bytes' source failed")


def race_put_ifs(store, name: str, threads: int) -> list[int]:
    """``threads`` threads, let go at once, each ``put_if(name, b"run <i>", None)``; those that won."""
    wins: list[int] = []
    start = threading.Barrier(threads)

    def race(i: int) -> None:
        start.wait()
        if store.put_if(name, f"run {i}".encode(), None):
            wins.append(i)

    running = [threading.Thread(target=race, args=(i,)) for i in range(threads)]
    for t in running:
        t.start()
    for t in running:
        t.join(timeout=60)
    return wins


class StoreTests:
    """The conformance suite; a subclass provides the ``store`` fixture."""

    def test_an_empty_store_lists_nothing_and_has_no_file(self, store):
        assert store.list() == {}
        assert store.size("a") is None and store.version("a") is None
        with pytest.raises(DatasetError):
            store.read("a")
        with pytest.raises(DatasetError):
            store.open("a")

    def test_put_from_any_bytes_like_reads_back_whole(self, store):
        chunks = [
            DATA[:100],
            bytearray(DATA[100:1000]),
            memoryview(torch.frombuffer(bytearray(DATA[1000:]), dtype=torch.uint8).numpy()),
        ]
        written = store.put("a", iter(chunks))
        assert store.read("a") == DATA
        assert store.list() == {"a": len(DATA)} and store.size("a") == len(DATA) == written.size

    def test_a_checksum_as_the_store_says(self, store):
        written = store.put("a", [DATA])
        if store.checksum == "sha256":
            assert written.sha256 == hashlib.sha256(DATA).hexdigest()
        else:
            assert store.checksum == "crc32" and written.crc32 == zlib.crc32(DATA)
        read = digest(store, "a")
        assert read.size == len(DATA) and read.sha256 == hashlib.sha256(DATA).hexdigest()
        assert read.crc32 == zlib.crc32(DATA)

    def test_put_replaces_a_file_whole(self, store):
        store.put("a", [b"old"])
        store.put("a", [DATA])
        assert store.read("a") == DATA and store.list() == {"a": len(DATA)}

    def test_a_failing_source_leaves_nothing_new(self, store):
        with pytest.raises(Boom):
            store.put("a", failing([DATA, DATA]))
        assert store.list() == {} and store.size("a") is None

    def test_a_failing_source_leaves_the_old_file_as_it_was(self, store):
        store.put("a", [b"old"])
        with pytest.raises(Boom):
            store.put("a", failing([DATA]))
        assert store.read("a") == b"old" and store.list() == {"a": 3}

    def test_then_is_handed_the_last_step_or_not_at_all(self, store):
        steps: list = []
        store.put("a", [DATA], then=steps.append)
        for step in steps:
            step()
        assert store.read("a") == DATA

    def test_open_reads_byte_ranges(self, store):
        store.put("a", [DATA])
        source = store.open("a")
        assert source.size == len(DATA) and source.where == store.path("a")
        assert bytes(source.read(0, 8)) == DATA[:8]
        assert bytes(source.read(300, 5000)) == DATA[300:5000]
        assert bytes(source.read(len(DATA) - 1, len(DATA))) == DATA[-1:]
        assert bytes(source.read(7, 7)) == b""

    def test_an_empty_file_opens_with_size_zero(self, store):
        store.put("a", [b""])
        assert store.open("a").size == 0 and store.read("a") == b"" and store.list() == {"a": 0}

    def test_remove_takes_one_file_and_a_missing_one_is_nothing(self, store):
        store.put("a", [b"1"])
        store.put("b", [b"2"])
        store.remove("a")
        store.remove("a")
        store.remove("never")
        assert store.list() == {"b": 1}

    def test_version_changes_when_a_file_is_put_again(self, store):
        store.put("a", [b"1"])
        first = store.version("a")
        store.put("a", [b"22"])
        assert first is not None and store.version("a") not in (None, first)

    def test_put_if_absent_writes_once(self, store):
        assert store.put_if("a", b"first", None) is True
        assert store.put_if("a", b"second", None) is False
        assert store.read("a") == b"first"

    def test_put_if_unchanged_refuses_a_stale_version(self, store):
        store.put_if("a", b"1", None)
        seen = store.version("a")
        assert store.put_if("a", b"2", seen) is True
        assert store.put_if("a", b"3", seen) is False  # another run wrote it since
        assert store.read("a") == b"2"
        assert store.put_if("missing", b"x", seen) is False and store.size("missing") is None

    def test_racing_put_ifs_commit_exactly_one(self, store):
        if not store.conditional_put:
            pytest.skip(f"{store.where}: put_if checks, then puts (conditional_put is False)")
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads (a server's too, in this process) switch between any two steps
        try:
            for r in range(30):
                wins = race_put_ifs(store, f"index-{r}", threads=6)
                assert len(wins) == 1, f"round {r}: {len(wins)} of 6 racing put_ifs won"
                assert store.read(f"index-{r}") == f"run {wins[0]}".encode()
        finally:
            sys.setswitchinterval(switch)

    def test_abort_uploads_never_raises(self, store):
        assert store.abort_uploads(["0123456789abcdef0123456789abcdef"]) == []  # none was left

    def test_a_dataset_commits_into_it_reads_back_and_is_replaced_only_with_overwrite(self, store):
        a, b = torch.randn(2, 3), torch.arange(4, dtype=torch.int64)
        frames = tdgather.gather({"a.mp4": [(0, a[0]), (1, a[1])], "b.mp4": [(0, {"ids": b, "text": "é"})]})
        sink = functools.partial(DatasetWriter, store=store)
        tdgather.save(frames, store.where, sink=sink)
        ds = Dataset(store.where, store=store)
        assert list(ds) == ["a.mp4", "b.mp4"] and torch.equal(ds["a.mp4"].frames, a)
        assert torch.equal(ds["b.mp4"].frames[0]["ids"], b) and ds["b.mp4"].frames[0]["text"] == "é"
        assert ds.verify() == len(ds.index["shards"])
        with pytest.raises(OutputError, match="overwrite=True"):
            tdgather.save(frames, store.where, sink=sink)
        tdgather.save(tdgather.gather({"c.mp4": [(0, a[0])]}), store.where, overwrite=True, sink=sink)
        assert list(Dataset(store.where, store=store)) == ["c.mp4"]

    def test_a_shard_written_by_the_codec_reads_back_through_open(self, store):
        x = torch.arange(60, dtype=torch.float32).reshape(20, 3)
        ids = torch.arange(20)
        entries = [("x", torch.float32, (20, 3), [x[:7], x[7:]]), ("ids", torch.int64, (20,), [ids])]
        store.put("shard", encode(entries, {"format": "test"}))
        f = SafetensorsFile(store.open("shard"))
        assert f.keys() == ["ids", "x"] and f.metadata() == {"format": "test"}
        assert torch.equal(f.get_slice("x")[5:12], x[5:12]) and torch.equal(f.get_tensor("ids"), ids)
        assert f.get_slice("x")[19:40].shape == (1, 3)  # clamped to the tensor

    def test_a_file_of_several_blocks_is_whole_or_absent(self, store):
        block = getattr(store, "block_bytes", 1 << 20)  # an object store uploads a file this large in parts
        data = torch.randint(0, 256, (2 * block + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        chunks = [memoryview(data[i : i + (3 << 20)].numpy()) for i in range(0, data.numel(), 3 << 20)]
        with pytest.raises(Boom):
            store.put("big", failing(chunks[:-1]))
        assert store.size("big") is None
        assert store.put("big", iter(chunks)).size == data.numel()
        source = store.open("big")
        assert bytes(source.read(block - 3, block + 3)) == data[block - 3 : block + 3].numpy().tobytes()
        assert store.read("big") == data.numpy().tobytes()
