"""Many jobs appending to one dataset (``append=True``, `tdgather.storage.append`): the edges.

Six jobs committing at once (threads, their first commits held until all six race for snapshot 1)
to one S3 prefix (a moto server) and to one directory, their shares overlapping: every frame
once, bit for bit, every snapshot whole and each one's frames in the next. A frame sent again with
another value (the first committed copy stays); duplicates scattered through a job, ragged trees;
appending to a dataset written plainly (snapshot 0); a job that fails before its commit (nothing
seen; a rerun commits once); what is refused, and what a hand-edited snapshot gives. The
``xfail`` tests are known bugs, each a minimal repro: they pass once it is fixed (then drop the mark).
"""

from __future__ import annotations

import json
import threading
import uuid
import zlib
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import tdgather
from tdgather.errors import DatasetError, OutputError
from tdgather.format.names import SNAPSHOT_NAME, snapshot_name
from tdgather.storage.append import AppendOutput
from tdgather.storage.objects import ObjectStore
from tdgather.storage.store import LocalStore
from tdgather.storage.writer import DatasetWriter

from .cases import assert_same_value

JOBS = 6


def value(name: str, idx: int) -> torch.Tensor:
    """The value of frame ``idx`` of ``name``: any job's copy of it is this, so any kept copy is checkable."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{idx}".encode()))
    return torch.randn(2, 3, generator=g)


def box_value(idx: int) -> dict[str, torch.Tensor]:
    """A tree with a ragged leaf (``boxes`` of 1 to 3 rows), from ``idx`` alone."""
    return {"boxes": torch.arange(float(idx % 3 + 1) * 4).reshape(-1, 4) + idx, "score": torch.tensor(idx / 7)}


def share(job: int) -> dict[str, list]:
    """Job ``job``'s predictions: frames job*3 .. job*3+5 of "a" and "b" (overlapping its neighbours'), and its own."""
    preds: dict[str, list] = {name: [(i, value(name, i)) for i in range(job * 3, job * 3 + 6)] for name in ("a", "b")}
    preds[f"own-{job}"] = [(0, value(f"own-{job}", 0)), (7, value(f"own-{job}", 7))]
    return preds


def contents(ds: Any) -> dict[tuple[str, int], Any]:
    """``{(filename, frame_idx): frame}`` of an opened dataset; each frame must be there once."""
    out: dict[tuple[str, int], Any] = {}
    for name in ds:
        f = ds[name]
        idx = f.frame_idx.tolist()
        assert len(set(idx)) == len(idx), f"{name}: a frame listed twice: {idx}"
        for row, i in enumerate(idx):
            out[(name, i)] = f.frames[row]
    assert len(out) == ds.metadata["total_frames"]
    assert len(ds) == ds.metadata["num_filenames"]
    return out


def assert_values(got: dict[tuple[str, int], Any], want: Any) -> None:
    """Each frame bit for bit as ``want(filename, frame_idx)`` gives it."""
    for (name, i), frame in got.items():
        assert_same_value(frame, want(name, i), f"{name}[{i}]")


def save(preds: dict[str, list], path: Any, **kw: Any) -> Any:
    return tdgather.save(tdgather.gather(preds), path, **kw)


# ---------------------------------------------------------------- six jobs at once: on S3, in a directory


def six_jobs_at_once(target: Any, store: type, monkeypatch: Any, opens_first: bool = False, **options: Any) -> None:
    """Six jobs append their `share` to ``target`` at once; check the dataset and every snapshot of it.

    ``opens_first``: every job has opened the output (listed it) before any job writes a shard
    (`test_a_listing_that_races_another_jobs_first_upload_is_not_a_foreign_object`, a known bug).
    """
    gathered = [tdgather.gather(share(job)) for job in range(JOBS)]
    sent = {(name, i) for job in range(JOBS) for name, items in share(job).items() for i, _ in items}
    per_job = sum(len(items) for items in share(0).values())
    dropped = JOBS * per_job - len(sent)
    assert dropped == 30  # 5 neighbours share 3 frames of "a" and 3 of "b"

    # every job's first commit is held until all six make it: one wins snapshot 1, five lose and retry
    real, held, lost, lock = store.put_if, set(), [], threading.Lock()
    first = threading.Barrier(JOBS, timeout=60)

    def put_if(self, name, data, expected):
        if SNAPSHOT_NAME.fullmatch(name) and threading.get_ident() not in held:
            held.add(threading.get_ident())
            first.wait()
        ok = real(self, name, data, expected)
        if not ok:
            with lock:
                lost.append(name)
        return ok

    monkeypatch.setattr(store, "put_if", put_if)
    opened, real_open = threading.Barrier(JOBS, timeout=60), AppendOutput.open

    def open_(self, overwrite, resume):
        state = real_open(self, overwrite, resume)
        opened.wait()
        return state

    if opens_first:
        monkeypatch.setattr(AppendOutput, "open", open_)
    start, errors = threading.Barrier(JOBS, timeout=60), {}

    def job(i: int) -> None:
        try:
            start.wait()
            tdgather.save(gathered[i], target, append=True, **options)
        except BaseException as e:  # reported below, with the job
            errors[i] = e
            first.abort()
            opened.abort()

    threads = [threading.Thread(target=job, args=(i,)) for i in range(JOBS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == {}
    assert lost.count(snapshot_name(1)) == JOBS - 1  # the commits did race

    ds = tdgather.open(target, **options)
    got = contents(ds)
    assert set(got) == sent  # every frame, once
    assert_values(got, value)
    assert ds.metadata["duplicates_dropped"] == dropped
    assert ds.verify() == len(ds.index["shards"])  # every listed shard there, every byte as its checksum says

    snaps = tdgather.snapshots(target, **options)
    assert [s.version for s in snaps] == list(range(1, JOBS + 1))
    assert sum(s.added for s in snaps) == len(sent)
    assert sum(s.duplicates_dropped for s in snaps) == dropped
    assert len({s.run for s in snaps}) == JOBS
    before: set = set()
    for k, s in enumerate(snaps, start=1):
        assert s.added + s.duplicates_dropped == per_job  # each job's frames: added, or already there
        assert s.made is not None and s.host
        old = tdgather.open(target, version=k, **options)
        assert old.index["snapshot"]["version"] == k
        assert old.index["snapshot"]["parent"] == (k - 1 if k > 1 else None)
        frames = contents(old)
        assert len(frames) == s.frames == sum(x.added for x in snaps[:k])
        assert len(old) == s.filenames
        assert before <= set(frames)  # nothing a concurrent commit lost
        assert_values(frames, value)
        before = set(frames)
    assert before == sent


def test_six_jobs_committing_at_once_to_s3_keep_every_frame_once(s3, url, monkeypatch):
    six_jobs_at_once(url, ObjectStore, monkeypatch, storage_options=s3)


def test_six_jobs_committing_at_once_to_a_directory_keep_every_frame_once(tmp_path, monkeypatch):
    six_jobs_at_once(tmp_path / "ds", LocalStore, monkeypatch)
    assert not list((tmp_path / "ds").glob(".*"))  # no temporary file left


def test_a_listing_that_races_another_jobs_first_upload_is_not_a_foreign_object(s3, url):
    """s3fs's ``find`` answers with the prefix itself, as a directory, when its listing found nothing but another
    job's first upload landed before its follow-up request: a filesystem registered for ``s3://`` (fsspec's own
    seam) gives that answer once."""
    import fsspec
    import s3fs

    raced = []

    class RacyS3(s3fs.S3FileSystem):
        def find(self, path, *args, **kwargs):
            found = super().find(path, *args, **kwargs)
            if kwargs.get("detail") and not raced:
                raced.append(path)
                return {path: {"name": path, "type": "directory", "size": 0}, **found}
            return found

    save({"a": [(0, value("a", 0))]}, url, append=True, storage_options=s3)
    fsspec.register_implementation("s3", RacyS3, clobber=True)
    try:
        save({"a": [(1, value("a", 1))]}, url, append=True, storage_options=s3)  # before the fix: "holds ... ('.')"
    finally:
        fsspec.register_implementation("s3", s3fs.S3FileSystem, clobber=True)
    assert raced
    assert sorted(contents(tdgather.open(url, storage_options=s3))) == [("a", 0), ("a", 1)]


def test_a_dataset_jobs_append_to_is_never_rewritten_in_place(s3, url, tmp_path):
    """Another job may be committing: overwrite=True (or a plain write, or resume) is refused, nothing removed."""
    for where, opts in ((url, {"storage_options": s3}), (tmp_path / "ds", {})):
        save({"a": [(0, torch.ones(2))]}, where, **opts)
        save({"b": [(0, torch.ones(2))]}, where, append=True, **opts)
        for kw in ({"overwrite": True}, {}):
            with pytest.raises(OutputError, match=r"is a dataset that jobs append to \(snapshots 1\.\.1\): add to it"):
                save({"q": [(0, torch.zeros(2))]}, where, **kw, **opts)
        ds = tdgather.open(where, **opts)
        assert list(ds) == ["a", "b"] and all(len(ds[n]) == 1 for n in ds)


# ---------------------------------------------------------------- which copy stays


@pytest.mark.parametrize("second", ["save", "collector"])
def test_the_first_committed_copy_stays_when_values_differ(tmp_path, second):
    path = tmp_path / "ds"
    a, b, c = torch.full((3,), 1.5), torch.full((3,), -2.25), torch.arange(3.0)
    save({"x": [(0, a)]}, path, append=True)
    if second == "save":
        save({"x": [(0, b), (1, c)]}, path, append=True)
    else:  # a Collector in one process, no process group
        with tdgather.Collector(path, append=True, progress=False) as col:
            col.add("x", [0, 1], torch.stack([b, c]))
    ds = tdgather.open(path)
    assert ds["x"].frame_idx.tolist() == [0, 1]
    assert_same_value(ds["x"].frames[0], a, "x[0]")  # A, the first committed copy
    assert_same_value(ds["x"].frames[1], c, "x[1]")
    assert ds.metadata["duplicates_dropped"] == 1
    first = tdgather.open(path, version=1)
    assert first["x"].frame_idx.tolist() == [0]
    assert_same_value(first["x"].frames[0], a, "x[0] at version 1")
    s1, s2 = tdgather.snapshots(path)
    assert (s1.version, s1.added, s1.duplicates_dropped, s1.frames) == (1, 1, 0, 1)
    assert (s2.version, s2.added, s2.duplicates_dropped, s2.frames) == (2, 1, 1, 2)


def test_duplicates_scattered_through_a_job_and_ragged_trees(tmp_path):
    path = tmp_path / "ds"
    save({"a": [(i, box_value(i)) for i in range(0, 10, 2)]}, path, append=True)  # the even frames
    save({"a": [(i, box_value(i)) for i in range(12)]}, path, append=True)  # every frame: the even ones again
    save({"a": [(i, box_value(i)) for i in range(3, 9)]}, path, append=True)  # nothing new
    ds = tdgather.open(path)
    got = contents(ds)
    assert sorted(got) == [("a", i) for i in range(12)]
    assert_values(got, lambda name, i: box_value(i))
    assert ds.metadata["duplicates_dropped"] == 5 + 6
    assert [(s.added, s.duplicates_dropped, s.frames) for s in tdgather.snapshots(path)] == [
        (5, 0, 5),
        (7, 5, 12),
        (0, 6, 12),
    ]
    # the third job added nothing: its shard is there, unlisted
    listed = set(ds.index["shards"])
    on_disk = {p.name for p in path.glob("shard-*.safetensors")}
    assert len(on_disk) == 3 and len(listed) == 2 and listed < on_disk
    assert ds.verify() == 2


# ---------------------------------------------------------------- an existing dataset


def test_appending_to_a_dataset_written_plainly(tmp_path):
    path = tmp_path / "ds"
    original = {"a": [(i, value("a", i)) for i in range(4)], "b": [(0, value("b", 0))]}
    save(original, path)
    index = (path / "tdgather.index.json").read_bytes()
    more = {"a": [(i, value("a", i) + 1) for i in range(2, 7)], "c": [(5, value("c", 5))]}  # a[2], a[3] differ
    save(more, path, append=True)

    snaps = tdgather.snapshots(path)
    assert [s.version for s in snaps] == [0, 1]
    assert (snaps[0].made, snaps[0].added, snaps[0].frames, snaps[0].filenames) == (None, 5, 5, 2)
    assert (snaps[1].added, snaps[1].duplicates_dropped, snaps[1].frames, snaps[1].filenames) == (4, 2, 9, 3)
    assert (path / "tdgather.index.json").read_bytes() == index  # snapshot 0 is never rewritten

    old = contents(tdgather.open(path, version=0))
    assert sorted(old) == [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0)]
    assert_values(old, value)
    new = tdgather.open(path)
    assert new.index["snapshot"]["parent"] == 0
    got = contents(new)
    assert set(got) == set(old) | {("a", 4), ("a", 5), ("a", 6), ("c", 5)}

    def kept(name: str, i: int) -> torch.Tensor:  # the original a[2], a[3]; the new job's a[4:7] (its values + 1)
        return value(name, i) + 1 if name == "a" and i > 3 else value(name, i)

    assert_values(got, kept)
    assert new.metadata["duplicates_dropped"] == 2


# ---------------------------------------------------------------- refusals


def test_append_with_overwrite_is_refused(tmp_path):
    path = tmp_path / "ds"
    words = r"append=True adds this job's frames to the dataset as a new snapshot; {}=True does not go with it"
    with pytest.raises(OutputError, match=words.format("overwrite")):
        DatasetWriter(path, append=True, overwrite=True)
    with pytest.raises(OutputError, match=words.format("overwrite")):
        with tdgather.Collector(path, append=True, overwrite=True, progress=False):
            pass
    with pytest.raises(OutputError, match=words.format("overwrite")):
        save({"a": [(0, torch.ones(2))]}, path, append=True, overwrite=True)
    assert not path.exists()


def test_a_directory_holding_a_file_tdgather_did_not_write_is_refused(tmp_path):
    path = tmp_path / "ds"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"holds files tdgather did not write \('notes\.txt'\)"):
        save({"a": [(0, torch.ones(2))]}, path, append=True)
    assert [p.name for p in path.iterdir()] == ["notes.txt"]


def test_a_store_without_an_atomic_conditional_write_is_refused():
    url = f"memory://append-{uuid.uuid4().hex[:8]}/ds"
    with pytest.raises(OutputError, match=r"append=True needs a store whose conditional write is atomic"):
        save({"a": [(0, torch.ones(2))]}, url, append=True)
    assert fsspec.filesystem("memory").find(url.removeprefix("memory://").split("/")[0]) == []


@pytest.fixture
def two(tmp_path) -> Path:
    """A dataset of two snapshots: ("a", 0), then ("a", 1) and ("b", 0)."""
    path = tmp_path / "ds"
    save({"a": [(0, value("a", 0))]}, path, append=True)
    save({"a": [(1, value("a", 1))], "b": [(0, value("b", 0))]}, path, append=True)
    return path


def test_a_version_not_there_is_refused_with_the_versions_there(two):
    with pytest.raises(OutputError, match=r"no snapshot version=99 \(there are: 1, 2\)"):
        tdgather.open(two, version=99)
    with pytest.raises(OutputError, match=r"no snapshot version=0 \(there are: 1, 2\)"):
        tdgather.open(two, version=0)  # no job wrote it plainly: no snapshot 0
    with pytest.raises(ValueError, match=r"version= reads a committed snapshot; incomplete=True"):
        tdgather.open(two, version=1, incomplete=True)


def test_a_snapshot_whose_record_disagrees_with_its_name_is_refused(two):
    f = two / snapshot_name(2)
    snap = json.loads(f.read_text())
    snap["snapshot"]["version"] = 5
    f.write_text(json.dumps(snap))
    with pytest.raises(DatasetError, match=r"snapshot\.version: expected 2, the number in its name, got 5"):
        tdgather.snapshots(two)


def test_a_snapshot_listing_a_shard_not_there_names_it_when_read(two):
    f = two / snapshot_name(2)
    snap = json.loads(f.read_text())
    gone = "shard-00000.0123456789ab-1.safetensors"
    snap["shards"][gone] = next(iter(snap["shards"].values()))
    snap["files"]["zz"] = {"frames": 1, "segments": [{"shard": gone, "group": "g0", "start": 0, "frames": 1}]}
    meta = snap["metadata"]
    meta.update(total_frames=meta["total_frames"] + 1, num_filenames=3, total_bytes=meta["total_bytes"] + 24)
    f.write_text(json.dumps(snap))
    ds = tdgather.open(two)  # the index is checked; a shard only when read
    assert_values({("a", i): ds["a"].frames[i] for i in (0, 1)}, value)
    missing = rf"{gone}: file: expected a regular file, got no such file"
    with pytest.raises(DatasetError, match=missing):
        ds["zz"]
    with pytest.raises(DatasetError, match=missing):
        ds.verify()


def test_another_jobs_shard_in_flight_does_not_stop_an_append(tmp_path):
    path = tmp_path / "ds"
    save({"a": [(0, value("a", 0))]}, path, append=True)
    (path / ".shard-00000.0123456789ab-1.safetensors.tmp-4242").write_bytes(b"half a shard")  # a job mid-write
    save({"a": [(1, value("a", 1))]}, path, append=True)
    assert sorted(contents(tdgather.open(path))) == [("a", 0), ("a", 1)]


# ---------------------------------------------------------------- a job that fails before its commit


def test_a_job_that_fails_before_its_commit_adds_nothing_and_its_rerun_commits_once(tmp_path):
    path = tmp_path / "ds"
    save({"a": [(0, value("a", 0))]}, path, append=True)
    snap1 = (path / snapshot_name(1)).read_bytes()
    job = {"a": [(i, value("a", i)) for i in range(3)], "b": [(4, value("b", 4))]}

    w = DatasetWriter(path, append=True)
    (orphan,) = w.write(tdgather.gather(job))
    w.abort(RuntimeError("the job was killed"))
    assert (path / orphan).is_file()  # its shard stays, unlisted
    assert sorted(p.name for p in path.iterdir() if p.name.startswith("tdgather.")) == [snapshot_name(1)]
    assert [s.version for s in tdgather.snapshots(path)] == [1]
    assert sorted(contents(tdgather.open(path))) == [("a", 0)]

    # a save that fails at its commit removes its shards
    class FailsAtCommit(DatasetWriter):
        def commit(self, metadata=None):
            raise RuntimeError("the job was killed at its commit")

    before = sorted(p.name for p in path.iterdir())
    with pytest.raises(RuntimeError, match="killed at its commit"):
        tdgather.save(tdgather.gather(job), path, append=True, sink=FailsAtCommit)
    assert sorted(p.name for p in path.iterdir()) == before

    save(job, path, append=True)  # the rerun
    assert (path / snapshot_name(1)).read_bytes() == snap1
    ds = tdgather.open(path)
    got = contents(ds)
    assert sorted(got) == [("a", 0), ("a", 1), ("a", 2), ("b", 4)]
    assert_values(got, value)
    assert orphan not in ds.index["shards"]
    _, s2 = tdgather.snapshots(path)
    assert (s2.version, s2.added, s2.duplicates_dropped) == (2, 3, 1)


# ---------------------------------------------------------------- known bugs


@pytest.mark.parametrize(
    "frame", [torch.ones(3, dtype=torch.int64), torch.ones(3, 2), {"x": torch.ones(3)}], ids=["dtype", "rank", "tree"]
)
def test_a_job_whose_frames_do_not_fit_leaves_the_dataset_readable(tmp_path, frame):
    path = tmp_path / "ds"
    save({"a": [(i, torch.ones(3)) for i in range(3)]}, path, append=True)
    try:
        save({"a": [(i, frame) for i in range(3, 6)]}, path, append=True)
    except tdgather.ShapeMismatchError:
        pass  # refused before its commit: fine
    ds = tdgather.open(path)
    assert ds["a"].frame_idx.tolist()[:3] == [0, 1, 2]
    save({"c": [(0, torch.ones(1))]}, path, append=True)
