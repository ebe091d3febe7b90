"""A local dataset lists each shard's CRC-32, as written: `verify()` and `tdgather inspect --verify` read every byte."""

import json
import struct
import zlib

import torch

import tdgather
from tdgather.format.names import INCOMPLETE_NAME, INDEX_NAME
from tdgather.storage.writer import DatasetWriter
from tdgather.tools.cli import main


def _frames(names, fill=1.0):
    return tdgather.gather({n: [(j, torch.full((64,), fill + j)) for j in range(3)] for n in names})


def _flip_a_value_bit(shard) -> None:
    """One bit of a frame's value (not its frame_idx, not the header): the file keeps its size and still opens."""
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__" and "frame_idx" not in k and "offsets" not in k)
    start, end = header[name]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def test_inspect_verify_catches_a_flipped_bit_in_a_local_dataset(tmp_path, capsys):
    out = tdgather.save(_frames(["a.mp4"]), tmp_path / "ds")
    entry = tdgather.open(out).index["shards"]["shard-00000.safetensors"]
    assert entry["crc32"] == zlib.crc32((out / "shard-00000.safetensors").read_bytes())  # as written
    assert main(["inspect", "--verify", str(out)]) == 0
    assert "verified: 1 of 1 shard(s): every byte matches" in capsys.readouterr().out
    _flip_a_value_bit(out / "shard-00000.safetensors")
    assert not torch.equal(tdgather.open(out)["a.mp4"].frames, _frames(["a.mp4"])["a.mp4"].frames)  # reads as it is
    assert main(["inspect", "--verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert "shard-00000.safetensors: crc32: expected CRC-32" in err and "the file changed since it was written" in err


def test_verify_of_a_dataset_without_checksums_says_so_and_fails(tmp_path, capsys):
    out = tdgather.save(_frames(["a.mp4", "b.mp4"]), tmp_path / "old", max_shard_bytes=1)  # a shard a filename
    index = json.loads((out / INDEX_NAME).read_text())
    index["version"] = 6  # as a tdgather before CRC-32s wrote it: sizes only, no schema
    del index["schema"]
    for entry in index["shards"].values():
        del entry["crc32"]
    (out / INDEX_NAME).write_text(json.dumps(index))
    assert sorted(tdgather.open(out)) == ["a.mp4", "b.mp4"] and tdgather.open(out).verify() == 0  # still opens
    assert main(["inspect", "--verify", str(out)]) == 1
    text = capsys.readouterr()
    assert "verified: 0 of 2 shard(s)" in text.out
    assert "2 of 2 shard(s) NOT verified: the index lists no checksum" in text.err and "tdgather.save(" in text.err
    assert main(["inspect", str(out)]) == 0  # not asked to verify content: headers and sizes, as before
    copy = tdgather.save(tdgather.open(out), tmp_path / "copy")  # the fix the message gives
    assert tdgather.open(copy).verify() == 1 and main(["inspect", "--verify", str(copy)]) == 0  # one shard


def test_a_resumed_run_lists_every_shard_with_its_crc32(tmp_path):
    for killed in (False, True):
        path = tmp_path / f"killed_{killed}"
        first = DatasetWriter(path, max_shard_bytes=1)
        first.write(_frames(["a.mp4", "b.mp4"]))
        first.abort(RuntimeError("planned"))
        if killed:  # rank dst killed: no record, each shard's CRC-32 is read from disk
            (path.with_name(path.name + ".partial") / INCOMPLETE_NAME).unlink()
        else:  # the record vouches for each shard as written: a bit flipped since is caught, not blessed
            _flip_a_value_bit(path.with_name(path.name + ".partial") / "shard-00000.safetensors")
        second = DatasetWriter(path, resume=True)
        second.write(_frames(["c.mp4"]))
        second.commit()
        ds = tdgather.open(path)
        assert sorted(ds) == ["a.mp4", "b.mp4", "c.mp4"] and all("crc32" in e for e in ds.index["shards"].values())
        if killed:
            assert ds.verify() == 3
        else:
            try:
                ds.verify()
            except tdgather.DatasetError as e:
                assert "shard-00000.safetensors: crc32" in str(e)
            else:
                raise AssertionError("a shard changed between attempts passed verify()")


def test_the_crc32_of_chunks_is_zlibs_whichever_library_computes_it():
    from tdgather.storage.store import crc32_of

    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    cuts = [0, 0, 1, 8, 4099, 1 << 20, (1 << 20) + 5, 3 << 20]
    chunks = [memoryview(data[a:b].numpy()) for a, b in zip(cuts, cuts[1:], strict=False)]
    crc = [0]
    assert [bytes(c) for c in crc32_of(chunks, crc)] == [bytes(c) for c in chunks]  # passed through as they are
    assert crc[0] == zlib.crc32(data.numpy().tobytes())
