"""The saved dataset: plain safetensors shards plus an index, atomic, read back lazily."""

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import tdgather
from tdgather.core.duplicates import DuplicateCounts
from tdgather.core.runs import add_runs, in_runs
from tdgather.errors import OutputError
from tdgather.format.names import INCOMPLETE_NAME, INDEX_NAME, RUN_NAME
from tdgather.storage.store import LocalStore
from tdgather.storage.writer import DatasetWriter

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
            idx = f.get_slice(f"{entry['group']}:frame_idx")[lo:hi]  # a plain tensor frame is the group's name
            frames = f.get_slice(entry["group"])[lo:hi]
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
    with pytest.raises(OutputError, match="already holds a tdgather dataset; pass overwrite=True"):
        tdgather.save(result, out)
    small = tdgather.gather({"only.mp4": (0, torch.ones(1))})
    tdgather.save(small, out, overwrite=True)
    assert list(tdgather.open(out)) == ["only.mp4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


USER_FILES = {"notes.txt": "mine", "model.safetensors": "weights"}


def _user_dir(path):
    path.mkdir(parents=True, exist_ok=True)
    for name, text in USER_FILES.items():
        (path / name).write_text(text)
    return path


def _assert_user_files_intact(path):
    for name, text in USER_FILES.items():
        assert (path / name).read_text() == text


@pytest.mark.parametrize("overwrite", [False, True])
def test_overwrite_never_deletes_a_directory_that_is_not_a_tdgather_dataset(tmp_path, overwrite):
    result = tdgather.gather({"a": (0, torch.ones(1))})
    target = _user_dir(tmp_path / "mine")
    with pytest.raises(
        OutputError,
        match=r"holds files tdgather did not write, or is not a complete tdgather dataset \(it holds 'model.safe"
        r"tensors', 'notes.txt'\); tdgather never replaces or deletes what it did not write",
    ):
        tdgather.save(result, target, overwrite=overwrite)
    _assert_user_files_intact(target)
    assert not (tmp_path / "mine.partial").exists()
    # a user's file inside a real dataset makes it "not ours" too: the dataset and the file stay
    ds = tdgather.save(result, tmp_path / "ds")
    (ds / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"holds 'notes.txt'"):
        tdgather.save(result, ds, overwrite=True)
    assert (ds / "notes.txt").read_text() == "mine" and list(tdgather.open(ds)) == ["a"]
    # shards without an index are not a dataset either
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "shard-00000.safetensors").write_bytes(b"x")  # not even a shard: a user's file with our name
    with pytest.raises(OutputError, match="holds files tdgather did not write.*'shard-00000.safetensors'"):
        tdgather.save(result, bare, overwrite=overwrite)
    assert (bare / "shard-00000.safetensors").read_bytes() == b"x"


@pytest.mark.parametrize("where", ["ds", "ds.partial"])
@pytest.mark.parametrize("name", ["shard-00099.safetensors", INCOMPLETE_NAME, RUN_NAME])
def test_a_users_file_named_like_tdgathers_is_never_deleted_by_overwrite(tmp_path, where, name):
    """Files are tdgather's by what they hold, not by their name alone (as in an object store)."""
    result = tdgather.gather({"a": (0, torch.ones(1))})
    tdgather.save(result, tmp_path / "ds")
    (tmp_path / where).mkdir(exist_ok=True)
    (tmp_path / where / name).write_text("my precious notes")
    with pytest.raises(OutputError, match=rf"(did not write.*{name}|{name}.*did not write)"):
        tdgather.save(result, tmp_path / "ds", overwrite=True)
    assert (tmp_path / where / name).read_text() == "my precious notes"
    assert list(tdgather.open(tmp_path / "ds")) == ["a"]


@pytest.mark.parametrize("dangling", [False, True])
def test_an_output_path_that_is_a_symlink_is_refused_and_nothing_is_deleted(tmp_path, dangling):
    result = tdgather.gather({"a": (0, torch.ones(1))})
    run1 = tdgather.save(result, tmp_path / "store" / "run1")
    before = sorted(os.listdir(run1))
    latest = tmp_path / "latest"
    latest.symlink_to(tmp_path / "store" / ("missing" if dangling else "run1"))
    for overwrite in (True, True, False):  # twice: the first refusal must leave nothing that breaks the second
        with pytest.raises(OutputError, match=r"latest' is a symbolic link .*pass the directory itself"):
            tdgather.save(result, latest, overwrite=overwrite)
        with pytest.raises(OutputError, match="is a symbolic link"):
            tdgather.Collector(latest, overwrite=overwrite).open()
    assert latest.is_symlink() and sorted(os.listdir(run1)) == before
    assert sorted(os.listdir(tmp_path)) == ["latest", "store"]
    (tmp_path / "other.partial").symlink_to(run1)
    with pytest.raises(OutputError, match=r"other.partial' is a symbolic link"):
        tdgather.save(result, tmp_path / "other", overwrite=True)
    assert sorted(os.listdir(run1)) == before


def test_a_user_directory_named_like_the_staging_directory_is_never_deleted(tmp_path):
    result = tdgather.gather({"a": (0, torch.ones(1))})
    _user_dir(tmp_path / "ds.partial")
    with pytest.raises(OutputError, match=r"ds.partial' is where tdgather stages .* holds 'model.safetensors'"):
        tdgather.save(result, tmp_path / "ds", overwrite=True)
    _assert_user_files_intact(tmp_path / "ds.partial")
    with pytest.raises(OutputError, match="is where tdgather stages"):
        tdgather.Collector(tmp_path / "ds", overwrite=True).open()
    _assert_user_files_intact(tmp_path / "ds.partial")


def test_a_file_that_appears_during_the_write_is_kept_with_the_old_dataset(tmp_path):
    result = tdgather.gather({"a": (0, torch.ones(1))})
    ds = tdgather.save(result, tmp_path / "ds")
    w = DatasetWriter(ds, overwrite=True)
    w.write(tdgather.gather({"b": (0, torch.ones(1))}))
    (ds / "notes.txt").write_text("mine")  # a user writes into the old dataset meanwhile
    with pytest.raises(OutputError, match="gained files tdgather did not write"):
        w.commit()
    assert (ds / "notes.txt").read_text() == "mine" and list(tdgather.open(ds)) == ["a"]


def test_a_failed_save_leaves_no_partial_directory(tmp_path):
    bad = dict(tdgather.gather({"a": (0, torch.ones(1))}))
    bad["b"] = "not frames"
    with pytest.raises(Exception):  # noqa: B017 - any error: the point is what stays on disk
        tdgather.save(bad, tmp_path / "ds")
    assert sorted(os.listdir(tmp_path)) == []


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
    w = DatasetWriter(tmp_path / "ds", max_shard_bytes=1 << 20)
    a = {j: value("a", j, (3,)) for j in range(6)}
    first = tdgather.gather({"a": [(j, a[j]) for j in (0, 2, 4)], "b": (0, value("b", 0))})
    second = tdgather.gather({"a": [(j, a[j]) for j in (1, 2, 5)], "c": (1, value("c", 1))})
    assert w.write(first) == ["shard-00000.safetensors"]
    assert w.write(second) == ["shard-00001.safetensors"]
    assert w.duplicates == DuplicateCounts(exact=1)  # frame 2 of "a" was already on disk, identical
    out = w.commit()
    ds = tdgather.open(out)
    assert [s["shard"] for s in ds.index["files"]["a"]["segments"]] == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    assert ds["a"].frame_idx.tolist() == [0, 1, 2, 4, 5]
    assert torch.equal(ds["a"].frames, torch.stack([a[j] for j in (0, 1, 2, 4, 5)]))
    assert ds.metadata["total_frames"] == 7


def test_rewritten_duplicates_follow_the_policy_against_the_disk(tmp_path):
    first = tdgather.gather({"a": [(0, torch.zeros(2)), (1, torch.ones(2))]})
    again = tdgather.gather({"a": [(0, torch.full((2,), 1e-6)), (1, torch.ones(2))]})  # one inexact, one exact
    w = DatasetWriter(tmp_path / "keep")
    w.write(first)
    w.write(again)
    assert w.duplicates == DuplicateCounts(exact=1, inexact=1, max_abs_diff=pytest.approx(1e-6))
    assert torch.equal(tdgather.open(w.commit())["a"].frames[0], torch.zeros(2))  # the copy on disk stays
    w = DatasetWriter(tmp_path / "close", duplicates=tdgather.DuplicatePolicy("close", atol=1e-5))
    w.write(first)
    w.write(again)
    assert w.duplicates.inexact == 1
    w = DatasetWriter(tmp_path / "tight", duplicates=tdgather.DuplicatePolicy("close", atol=1e-7))
    w.write(first)
    with pytest.raises(tdgather.DuplicateFrameError, match=r"close \(rtol=1e-05, atol=1e-07\)"):
        w.write(again)


def test_incremental_conflicts_raise_and_abort_keeps_committed_shards(tmp_path):
    w = DatasetWriter(tmp_path / "ds", duplicates="exact")
    w.write(tdgather.gather({"a": (0, torch.zeros(2))}), {"a": {0}})
    with pytest.raises(
        tdgather.DuplicateFrameError,
        match=r"'a', frame_idx 0: rank 0 and later rank 2 sent values that differ "
        r"\(the first copy was written to shard-00000.safetensors before this one arrived\) \(largest absolute "
        r"difference 1\), and the duplicates policy is 'exact'",
    ):
        w.write(tdgather.gather({"a": (0, torch.ones(2))}), {"a": {2}})
    with pytest.raises(
        tdgather.ShapeMismatchError,
        match=r"'a': frames already written \(from ranks \[0\]\) have float32\[2\], new ones \(from ranks \[1\]\)",
    ):
        w.write(tdgather.gather({"a": (1, torch.ones(2, dtype=torch.float64))}), {"a": {1}})
    partial = w.abort()
    assert partial == tmp_path / "ds.partial"
    assert sorted(os.listdir(partial)) == ["shard-00000.safetensors", RUN_NAME]  # the mark: resume continues this run
    assert not (tmp_path / "ds").exists()


@settings(deadline=None)  # a timing limit would fail a loaded CI machine, not a wrong answer
@given(st.lists(st.lists(st.integers(0, 400), min_size=1, max_size=150), min_size=1, max_size=6))
def test_written_frame_runs_match_a_set(batches):
    """The writer remembers frames written as runs: membership must equal a plain set's (few frames and runs
    take a path of plain Python, more a path of tensors: both are drawn here)."""
    runs, seen = None, set()
    probe = torch.arange(-3, 410)
    for idx in batches:
        runs = add_runs(runs, torch.tensor(idx))
        seen |= set(idx)
        assert in_runs(runs, probe).tolist() == [int(x) in seen for x in probe]
        assert bool((runs[1:, 0] > runs[:-1, 1] + 1).all())  # disjoint, not even touching
    assert sum(int(b - a + 1) for a, b in runs.tolist()) == len(seen)


def test_short_writes_are_resumed_and_the_shard_is_whole(tmp_path, monkeypatch):
    real = os.writev
    calls = []

    def short(fd, buffers):  # the kernel may write less than asked: at most 1000 bytes here
        calls.append(len(buffers))
        return real(fd, [memoryview(b).cast("B")[:1000] for b in buffers][:1])

    result, _ = gathered()
    monkeypatch.setattr(os, "writev", short)
    tdgather.save(result, tmp_path / "ds")
    monkeypatch.undo()
    assert len(calls) > 10
    assert_dataset_equals(tdgather.open(tmp_path / "ds"), result)


def test_a_shard_that_fails_to_become_durable_fails_the_commit_and_is_not_listed(tmp_path, monkeypatch):
    real = os.fsync

    def fsync(fd):  # the second shard's fsync fails (on the writer's background thread)
        if "shard-00001" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(5, "Input/output error")
        return real(fd)

    w = DatasetWriter(tmp_path / "ds", max_shard_bytes=1)
    monkeypatch.setattr(os, "fsync", fsync)
    w.write({"a.mp4": tdgather.Frames(frame_idx=torch.arange(2), frames=torch.ones(2, 3), batch_size=[2])})
    w.write({"b.mp4": tdgather.Frames(frame_idx=torch.arange(2), frames=torch.ones(2, 3), batch_size=[2])})
    with pytest.raises(OutputError, match="shard-00001.*Input/output error"):
        w.commit()
    monkeypatch.undo()
    partial = w.abort(RuntimeError("stopped"))
    listing = json.loads((partial / INCOMPLETE_NAME).read_text())
    assert list(listing["shards"]) == ["shard-00000.safetensors"] and list(listing["files"]) == ["a.mp4"]
    assert sorted(p.name for p in partial.iterdir()) == ["shard-00000.safetensors", INCOMPLETE_NAME, RUN_NAME]
    assert tdgather.open(partial, incomplete=True)["a.mp4"].frames.shape == (2, 3)


def test_listing_a_directory_while_another_writer_renames_its_files(tmp_path):
    """Writers share one directory: a temporary file put in place (or removed) while another writer lists it
    is left out, not a FileNotFoundError (benchmarks.combine opening a second writer failed so in 1 of 5 full runs)."""
    import threading

    store, stop = LocalStore(tmp_path), threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            tmp = tmp_path / f".shard-00000-{i % 50:05d}.safetensors.tmp"
            tmp.write_bytes(b"x" * (i % 7))
            if i % 2:
                os.replace(tmp, tmp_path / f"shard-00000-{i % 50:05d}.safetensors")
            else:
                tmp.unlink()
            i += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        listed = [store.list() for _ in range(2000)]  # about half of them met a vanished file before the fix
    finally:
        stop.set()
        thread.join()
    assert any(len(names) > 1 for names in listed)
    assert all(size < 7 for names in listed for size in names.values())
