"""The saved dataset: plain safetensors shards plus an index, atomic, read back lazily."""

import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

import tdgather
import tdgather.sink
from tdgather.errors import OutputError
from tdgather.sink import INDEX_NAME, _add_runs, _in_runs

from .cases import MIXED, DepthMask, assert_same_value, bits, value

HOSTILE = ["..", "../../etc/passwd", "/abs/path.mp4", "nul\x00byte", "__metadata__", "x" * 5000, "ünïcödé 🎞", ""]


def gathered():
    p = {name: [(j, value(name, j, shape, dt)) for j in range(3)] for name, (dt, shape) in MIXED.items()}
    p["nested.mp4"] = [
        (j, {"depth": value("d", j, (1, 2)), "meta": {"label": f"l{j}", "ok": j % 2 == 0}}) for j in range(4)
    ]
    p["tc.mp4"] = [
        (j, DepthMask(depth_map=value("t", j, (2,)), mask=value("m", j, (2,), torch.bool), batch_size=[]))
        for j in (5, 2)
    ]
    for name in HOSTILE:
        p[name] = (1, value(name, 1, (2,)))
    return tdgather.gather(p), p


def assert_dataset_equals(ds, result):
    assert sorted(ds) == sorted(result)
    for name, f in result.items():
        got = ds[name]
        assert torch.equal(got.frame_idx, f.frame_idx)
        assert_same_value(got.frames, f.frames, name)


@pytest.mark.parametrize("max_shard_bytes", [1 << 30, 64])
def test_save_and_open_roundtrip(tmp_path, max_shard_bytes):
    result, _ = gathered()
    out = tdgather.save(result, tmp_path / "ds", max_shard_bytes=max_shard_bytes)
    files = sorted(os.listdir(out))
    assert INDEX_NAME in files and all(f == INDEX_NAME or f.startswith("shard-") for f in files)
    assert (len(files) > 2) == (max_shard_bytes == 64)
    ds = tdgather.open(out)
    assert_dataset_equals(ds, result)
    assert ds.metadata["total_frames"] == result.stats.frames
    assert isinstance(ds["tc.mp4"].frames, DepthMask)
    assert ds["nested.mp4"].frames["meta", "label"] == ["l0", "l1", "l2", "l3"]
    assert not list(tmp_path.glob("**/.*tmp*")) and not (tmp_path / "ds.partial").exists()


def test_shards_read_with_plain_safetensors(tmp_path):
    result, _ = gathered()
    out = tdgather.save(result, tmp_path / "ds")
    index = json.loads((out / INDEX_NAME).read_text())
    for name in ["bf16.mp4", "f8.mp4", "bool.mp4", "../../etc/passwd", "__metadata__"]:
        [entry] = index["files"][name]["segments"]
        lo, hi = entry["start"], entry["start"] + entry["frames"]
        with safe_open(out / entry["shard"], framework="pt") as f:
            assert f.metadata()["format"] == "tdgather"
            idx = f.get_slice(f"{entry['group']}.frame_idx")[lo:hi]
            frames = f.get_slice(f"{entry['group']}.leaf0")[lo:hi]
        assert torch.equal(idx, result[name].frame_idx)
        assert frames.dtype == result[name].frames.dtype
        assert torch.equal(bits(frames), bits(result[name].frames))


def test_empty_dataset(tmp_path):
    out = tdgather.save(tdgather.gather({}), tmp_path / "empty")
    ds = tdgather.open(out)
    assert len(ds) == 0 and ds.metadata["total_frames"] == 0
    assert os.listdir(out) == [INDEX_NAME]


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    result, _ = gathered()
    out = tdgather.save(result, tmp_path / "ds")
    with pytest.raises(OutputError, match="exists and is not empty; pass overwrite=True"):
        tdgather.save(result, out)
    small = tdgather.gather({"only.mp4": (0, torch.ones(1))})
    tdgather.save(small, out, overwrite=True)
    assert list(tdgather.open(out)) == ["only.mp4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_bad_output_paths_are_refused_before_writing(tmp_path):
    result = tdgather.gather({"a": (0, torch.ones(1))})
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="expected a directory, got a file"):
        tdgather.save(result, tmp_path / "file")
    with pytest.raises(OutputError, match="cannot create its parent directory"):
        tdgather.save(result, tmp_path / "file" / "sub" / "ds")
    (tmp_path / "ds.partial").mkdir()
    with pytest.raises(OutputError, match="left by an interrupted run"):
        tdgather.save(result, tmp_path / "ds")
    with pytest.raises(OutputError, match="not a complete tdgather dataset: no tdgather.index.json; .*interrupted"):
        tdgather.open(tmp_path / "ds")
    tdgather.save(result, tmp_path / "ds", overwrite=True)
    assert not (tmp_path / "ds.partial").exists() and list(tdgather.open(tmp_path / "ds")) == ["a"]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_reading_one_filename_reads_only_its_rows(tmp_path):
    p = {f"v{i:03d}": [(j, torch.full((25_000,), float(i))) for j in range(5)] for i in range(200)}  # 100 MB
    out = tdgather.save(tdgather.gather(p), tmp_path / "ds")
    del p
    ds = tdgather.open(out)
    before = _resident_bytes()
    got = ds["v117"]
    grown = _resident_bytes() - before
    assert got.frames.shape == (5, 25_000) and bool((got.frames == 117).all())
    assert grown < 20_000_000, f"reading 0.5 MB of a 100 MB shard made {grown} bytes resident"


def test_incremental_writes_make_segments_and_drop_rewritten_duplicates(tmp_path):
    w = tdgather.sink.DatasetWriter(tmp_path / "ds", max_shard_bytes=1 << 20)
    a = {j: value("a", j, (3,)) for j in range(6)}
    first = tdgather.gather({"a": [(j, a[j]) for j in (0, 2, 4)], "b": (0, value("b", 0))})
    second = tdgather.gather({"a": [(j, a[j]) for j in (1, 2, 5)], "c": (1, value("c", 1))})
    assert w.write(first) == ["shard-00000.safetensors"]
    assert w.write(second) == ["shard-00001.safetensors"]
    assert w.duplicates_dropped == 1  # frame 2 of "a" was already on disk, identical
    out = w.commit()
    ds = tdgather.open(out)
    assert [s["shard"] for s in ds.index["files"]["a"]["segments"]] == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    assert ds["a"].frame_idx.tolist() == [0, 1, 2, 4, 5]
    assert torch.equal(ds["a"].frames, torch.stack([a[j] for j in (0, 1, 2, 4, 5)]))
    assert ds.metadata["total_frames"] == 7


def test_incremental_conflicts_raise_and_abort_keeps_committed_shards(tmp_path):
    w = tdgather.sink.DatasetWriter(tmp_path / "ds")
    w.write(tdgather.gather({"a": (0, torch.zeros(2))}))
    with pytest.raises(tdgather.DuplicateFrameError, match=r"'a', frame_idx 0: arrived again with a different value"):
        w.write(tdgather.gather({"a": (0, torch.ones(2))}))
    with pytest.raises(tdgather.ShapeMismatchError, match=r"'a': frames already written have float32\[2\]"):
        w.write(tdgather.gather({"a": (1, torch.ones(3))}))
    partial = w.abort()
    assert partial == tmp_path / "ds.partial" and sorted(os.listdir(partial)) == ["shard-00000.safetensors"]
    assert not (tmp_path / "ds").exists()


@given(st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=30), min_size=1, max_size=6))
def test_written_frame_runs_match_a_set(batches):
    """The writer remembers frames written as runs: membership must equal a plain set's."""
    runs, seen = None, set()
    probe = torch.arange(-3, 70)
    for idx in batches:
        runs = _add_runs(runs, torch.tensor(idx))
        seen |= set(idx)
        assert _in_runs(runs, probe).tolist() == [int(x) in seen for x in probe]
        assert bool((runs[1:, 0] > runs[:-1, 1] + 1).all())  # disjoint, not even touching
    assert sum(int(b - a + 1) for a, b in runs.tolist()) == len(seen)
