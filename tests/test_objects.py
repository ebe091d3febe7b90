"""Object store outputs (`tdgather.storage.objects`, `tdgather.storage.prefix`): any fsspec URL.

Against a real S3 API on localhost (moto's server, through s3fs, as a user would) in real gloo
worlds: a Collector, gather + save, resume after a rank or rank dst (mid-upload) is SIGKILLed, bit
for bit against an uninterrupted local run (through `tdgather.open`, and through plain safetensors
reading of the downloaded shards); many writers with no shared filesystem; overwrite; a shard
altered after commit; a prefix with no index. And ``memory://`` in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import torch

import tdgather
from tdgather import saved_at
from tdgather.errors import DatasetError, OutputError
from tdgather.format.names import INCOMPLETE_NAME, INDEX_NAME, RUN_NAME, SHARD_NAME
from tdgather.tools.cli import main as cli
from tdgather.tools.launch import WorldError, run_local_world

from . import faults
from . import resume_cases as rc
from .cases import bits
from .test_resume import assert_same_dataset

pytestmark = pytest.mark.world


def s3fs_of(options: dict):
    import s3fs

    return s3fs.S3FileSystem(**options, skip_instance_cache=True)


def objects(options: dict, url: str) -> list[str]:
    fs = s3fs_of(options)
    root = url.removeprefix("s3://")
    return sorted(p[len(root) + 1 :] for p in fs.find(root))


def download(options: dict, url: str, to: Path) -> Path:
    """The dataset's objects as a local directory (what a user gets with ``aws s3 cp --recursive``)."""
    s3fs_of(options).get(url.removeprefix("s3://") + "/", str(to) + "/", recursive=True)
    return to


def attempt(url: str, options: dict, resume: bool, kill: dict | None = None) -> list:
    args = (rc.case_run, 3, url, resume, kill, 4, "same", None, options)
    if kill is None:
        return run_local_world(*args, timeout=150)
    with pytest.raises(WorldError) as e:
        run_local_world(*args, timeout=150)
    assert e.value.failures[kill["rank"]] == "exited with code -9 and no result", e.value.failures
    return e.value.results


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, to a local directory."""
    out = tmp_path_factory.mktemp("ref") / "ds"
    run_local_world(rc.case_run, 3, str(out), False, None, timeout=150)
    return out


def assert_same_on_s3(options: dict, url: str, reference: Path, tmp: Path) -> None:
    """Through `tdgather.open` on the URL, and on a download read by plain safetensors: the reference's frames."""
    ds, want = tdgather.open(url, storage_options=options), tdgather.open(reference)
    assert sorted(ds) == sorted(want)
    for name in want:
        assert torch.equal(ds[name].frame_idx, want[name].frame_idx)
        for leaf in ("depth", "feat"):
            assert torch.equal(bits(ds[name].frames[leaf]), bits(want[name].frames[leaf])), (name, leaf)
    assert ds.verify() == len(ds.index["shards"]) > 0  # every shard's size and sha256
    assert_same_dataset(download(options, url, tmp / "downloaded"), reference)


def test_a_collector_writes_to_s3_what_it_writes_locally(s3, url, reference, tmp_path):
    attempt(url, s3, resume=False)
    names = objects(s3, url)
    assert names[-1] == INDEX_NAME and all(SHARD_NAME.fullmatch(n) for n in names[:-1])
    run = tdgather.open(url, storage_options=s3).metadata["run"]
    assert all(f".{run[:12]}-1." in n for n in names[:-1])  # named by run and attempt: never another's
    index = json.loads(s3fs_of(s3).cat_file(url.removeprefix("s3://") + "/" + INDEX_NAME))
    assert index["version"] == 8
    sizes = {
        p.rsplit("/", 1)[1]: i["size"] for p, i in s3fs_of(s3).find(url.removeprefix("s3://"), detail=True).items()
    }
    assert all(entry["size"] == sizes[name] for name, entry in index["shards"].items())
    assert_same_on_s3(s3, url, reference, tmp_path)
    assert not s3fs_of(s3).call_s3("list_multipart_uploads", Bucket=url.split("/")[2]).get("Uploads")


def test_gather_and_save_to_s3(s3, url):
    results = run_local_world(rc.case_gather_save, 2, url, s3, timeout=120)
    ds = tdgather.open(url, storage_options=s3)
    assert sorted(ds) == ["clip_0.mp4", "clip_1.mp4"]
    for r in range(2):
        got = ds[f"clip_{r}.mp4"]
        assert got.frame_idx.tolist() == [0, 1, 2]
        assert torch.equal(got.frames["depth"], torch.full((3, 2, 2), float(r)))
    assert results[0]["saved"] == url and results[1]["saved"] is None


def test_a_rank_killed_then_resumed_on_s3_equals_the_uninterrupted_run(s3, url, reference, tmp_path):
    attempt(url, s3, resume=False, kill={"rank": 1, "batch": 4})
    names = objects(s3, url)
    assert INDEX_NAME not in names and INCOMPLETE_NAME in names  # no commit: the failure's record instead
    with pytest.raises(OutputError, match="incomplete=True"):
        tdgather.open(url, storage_options=s3)
    first = tdgather.open(url, incomplete=True, storage_options=s3).metadata["total_frames"]
    assert 0 < first < 87
    r = attempt(url, s3, resume=True)
    assert {x["saved_frames"] for x in r} == {first}
    assert_same_on_s3(s3, url, reference, tmp_path)
    a = tdgather.open(url, storage_options=s3).metadata["attempts"]
    assert [x["frames"] for x in a] == [first, 87 - first] and a[0]["failure"]["rank"] == 1
    assert INCOMPLETE_NAME not in objects(s3, url)  # the commit removed the record


def uploads(options: dict, url: str) -> list[str]:
    """The keys (under the bucket) of the multipart uploads begun and never completed nor aborted."""
    found = s3fs_of(options).call_s3("list_multipart_uploads", Bucket=url.split("/")[2]).get("Uploads", [])
    return sorted(u["Key"] for u in found)


def test_rank_dst_killed_mid_upload_then_resumed(s3, url, reference, tmp_path):
    attempt(url, s3, resume=False, kill={"rank": 0, "write": 4})
    names = objects(s3, url)
    assert [n for n in names if SHARD_NAME.fullmatch(n)] == names[:3] and names[3:] == [RUN_NAME]  # no 4th shard
    left = uploads(s3, url)  # the 4th shard's upload, begun: its parts are stored (and billed) until aborted
    assert len(left) == 1 and SHARD_NAME.fullmatch(left[0].rsplit("/", 1)[1]) and ".safetensors" in left[0]
    saved = saved_at(url, storage_options=s3).num_frames
    assert saved > 0  # read back from the shards' own records, in the store
    assert tdgather.open(url, incomplete=True, storage_options=s3).metadata["total_frames"] == saved
    attempt(url, s3, resume=True)
    assert_same_on_s3(s3, url, reference, tmp_path)
    a = tdgather.open(url, storage_options=s3).metadata["attempts"]
    assert a[0]["failure"]["type"] == "Unrecorded" and [x["frames"] for x in a] == [saved, 87 - saved]
    assert {n.split(".")[1].rsplit("-", 1)[1] for n in objects(s3, url) if SHARD_NAME.fullmatch(n)} == {"1", "2"}
    assert uploads(s3, url) == []  # the resumed run's commit aborted its killed attempt's upload


def test_a_commit_aborts_only_its_own_runs_unfinished_uploads(s3, url):
    """This run's (any attempt) and the replaced run's go; another run's (maybe live), other keys and prefixes stay."""
    from tdgather.storage.objects import ObjectStore

    fs, bucket = s3fs_of(s3), url.split("/")[2]
    root = url.removeprefix(f"s3://{bucket}/")
    keys = [
        f"{root}/shard-00003.{'a' * 12}-1.safetensors",  # this run's, a killed attempt
        f"{root}/shard-00000-00001.{'a' * 12}-2.safetensors",  # this run's, another writer's
        f"{root}/shard-00001.{'b' * 12}-1.safetensors",  # the replaced run's
        f"{root}/shard-00001.{'c' * 12}-1.safetensors",  # another run's
        f"{root}/shard-00001.safetensors",  # untagged
        f"{root}/notes.txt",
        f"{root}/sub/shard-00001.{'a' * 12}-1.safetensors",
        f"{root}2/shard-00001.{'a' * 12}-1.safetensors",  # another prefix
    ]
    for key in keys:
        fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    aborted = ObjectStore(url, s3).abort_uploads(["a" * 32, "b" * 12])
    assert sorted(aborted) == sorted(k.rsplit("/", 1)[1] for k in keys[:3])
    assert uploads(s3, url) == sorted(keys[3:])
    assert ObjectStore("memory://x/y").abort_uploads(["a" * 32]) == []  # only S3 lists uploads


def test_many_writers_share_no_filesystem(s3, url, reference, tmp_path):
    scratch = tmp_path / "scratch"  # each rank runs in its own empty directory under it
    scratch.mkdir()
    results = run_local_world(rc.case_run_in_scratch, 4, str(scratch), url, 2, s3, timeout=150)
    assert all(r["scratch"] == [] for r in results)  # nothing was written on any rank's disk
    writers = {n.split("-")[1] for n in objects(s3, url) if SHARD_NAME.fullmatch(n)}
    assert writers == {"00000", "00001"}  # both writers uploaded shards of their own
    assert_same_on_s3(s3, url, reference, tmp_path)


def frames(value: float, names=("a.mp4", "b.mp4")) -> tdgather.Gathered:
    store = tdgather.FrameStore()
    for name in names:
        store.add([name] * 3, [0, 1, 2], {"depth": torch.full((3, 4), value)})
    return tdgather.gather(store)


def test_overwrite_replaces_only_a_tdgather_prefix(s3, url):
    tdgather.save(frames(1.0), url, storage_options=s3)
    old = objects(s3, url)
    with pytest.raises(OutputError, match="overwrite=True"):
        tdgather.save(frames(2.0), url, storage_options=s3)
    assert objects(s3, url) == old
    tdgather.save(frames(2.0), url, storage_options=s3, overwrite=True)
    new = objects(s3, url)
    assert not set(old) & set(new[:-1]) and len(new) == len(old)  # the old shards removed, by name
    assert torch.equal(tdgather.open(url, storage_options=s3)["a.mp4"].frames["depth"], torch.full((3, 4), 2.0))
    fs = s3fs_of(s3)
    for foreign in ("notes.txt", "sub/shard-00000.safetensors"):
        fs.pipe_file(url.removeprefix("s3://") + "/" + foreign, b"mine")
        with pytest.raises(OutputError, match=f"did not write \\('{foreign}'\\)"):
            tdgather.save(frames(3.0), url, storage_options=s3, overwrite=True)
        assert fs.cat_file(url.removeprefix("s3://") + "/" + foreign) == b"mine"
        fs.rm_file(url.removeprefix("s3://") + "/" + foreign)
    assert objects(s3, url) == new  # refused before anything was written


def test_a_shard_altered_after_commit_is_caught_by_verify(s3, url, capsys):
    tdgather.save(frames(1.0), url, storage_options=s3)
    fs = s3fs_of(s3)
    shard = next(n for n in objects(s3, url) if SHARD_NAME.fullmatch(n))
    key = url.removeprefix("s3://") + "/" + shard
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 0x01  # one bit of the last value: the header still checks out
    fs.pipe_file(key, bytes(data))
    ds = tdgather.open(url, storage_options=s3)
    assert ds["a.mp4"].frame_idx.tolist() == [0, 1, 2]  # a lazy read does not read every byte
    with pytest.raises(DatasetError, match=f"{shard}: sha256: expected sha256 "):
        ds.verify()
    options = json.dumps(s3)
    assert cli(["inspect", url, "--storage-options", options]) == 0
    assert cli(["inspect", url, "--storage-options", options, "--verify"]) == 1
    assert "sha256" in capsys.readouterr().err


def test_a_prefix_without_an_index_is_no_dataset(s3, url):
    with pytest.raises(OutputError, match="no tdgather.index.json \\(nothing is stored under that prefix"):
        tdgather.open(url, storage_options=s3)
    with pytest.raises(OutputError, match="no failed run saved anything"):
        tdgather.open(url, incomplete=True, storage_options=s3)


# ---- memory:// in one process -----------------------------------------------------------------------


@pytest.fixture
def mem() -> str:
    import uuid

    return f"memory://tdgather-test-{uuid.uuid4().hex[:8]}/ds"


def test_a_commit_stands_when_removing_what_it_replaced_fails(mem, caplog):
    """After the index is put, the clean-up is storage only: its failure is logged, the commit returned."""
    import functools

    from tdgather.storage.objects import ObjectStore
    from tdgather.storage.writer import DatasetWriter

    class NoRemoves(ObjectStore):
        def remove(self, name: str) -> None:
            raise OSError(f"remove {name}: permission denied")

    store = NoRemoves(mem)
    sink = functools.partial(DatasetWriter, store=store)
    tdgather.save(tdgather.gather({"a.mp4": [(0, torch.ones(2))]}), mem, sink=sink)
    new = tdgather.gather({"b.mp4": [(0, torch.zeros(2))]})
    assert tdgather.save(new, mem, overwrite=True, sink=sink) == mem  # no error: the dataset is committed
    ds = tdgather.open(mem)
    assert list(ds) == ["b.mp4"] and ds.verify() == 1
    assert "committed; removing the objects the index does not list failed (OSError" in caplog.text
    assert len([n for n in store.list() if SHARD_NAME.fullmatch(n)]) == 2  # the old shard stays, unlisted


def test_memory_url_failed_collector_then_resume(mem):
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with tdgather.Collector(mem, max_shard_bytes=1) as col:
            col.add(["a.mp4"] * 2, [0, 1], {"depth": torch.ones(2, 3)})
            col.add(["b.mp4"], [0], {"depth": torch.zeros(1, 3)})
            raise Boom("the loop failed")
    failed = tdgather.open(mem, incomplete=True)
    assert failed.metadata["failure"]["type"] == "Boom" and failed.metadata["total_frames"] == 3
    with tdgather.Collector(mem, resume=True) as col:
        assert col.saved.num_frames == 3
        col.add(["a.mp4", "c.mp4"], [2, 0], {"depth": torch.full((2, 3), 2.0)})
    ds = tdgather.open(mem)
    assert ds["a.mp4"].frame_idx.tolist() == [0, 1, 2] and sorted(ds) == ["a.mp4", "b.mp4", "c.mp4"]
    assert [a["frames"] for a in ds.metadata["attempts"]] == [3, 2]
    assert ds.verify() == len(ds.index["shards"])
    fs = fsspec.filesystem("memory")
    assert not any(INCOMPLETE_NAME in p for p in fs.find(mem.removeprefix("memory://")))


def test_reading_is_lazy_byte_ranges(mem):
    store = tdgather.FrameStore()
    for v in range(20):
        store.add([f"v{v}.mp4"] * 4, range(4), {"depth": torch.full((4, 64, 64), float(v))})
    tdgather.save(tdgather.gather(store), mem)
    ds = tdgather.open(mem)
    fs = ds.store.fs
    shard = next(iter(ds.index["shards"]))
    total = fs.size(ds.store._key(shard))
    calls = []
    real = fs.cat_file

    def counted(path, start=None, end=None, **kw):
        data = real(path, start=start, end=end, **kw)
        calls.append(len(data))
        return data

    fs.cat_file = counted
    try:
        got = ds["v7.mp4"]
        item = ds.per_frame()[30]
    finally:
        del fs.cat_file
    assert torch.equal(got.frames["depth"], torch.full((4, 64, 64), 7.0))
    assert item is not None
    assert 0 < sum(calls) < total // 8  # the header and the rows asked for, not the shard
    assert max(calls) <= 4 * 64 * 64 * 4


def test_storage_options_with_a_local_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="storage_options.*local path"):
        tdgather.save(frames(1.0), tmp_path / "ds", storage_options={"key": "x"})
    with pytest.raises(ValueError, match="storage_options.*local path"):
        tdgather.Collector(tmp_path / "ds", storage_options={"key": "x"})


def test_a_file_url_is_the_local_path(tmp_path):
    out = tdgather.save(frames(1.0), f"file://{tmp_path}/ds")
    assert Path(out) == tmp_path / "ds" and (tmp_path / "ds" / INDEX_NAME).is_file()
    assert tdgather.open(f"file://{tmp_path}/ds")["b.mp4"].frame_idx.tolist() == [0, 1, 2]


def test_two_runs_committing_one_prefix_one_commits_the_other_is_refused_naming_it(mem):
    """The commit is conditional on the index seen at open: the second run fails, naming the first."""
    from tdgather.storage.writer import DatasetWriter

    a = DatasetWriter(mem)
    b = DatasetWriter(mem)  # started before a commits: both see an empty prefix
    a.write(frames(1.0))
    b.write(frames(2.0, names=("c.mp4",)))
    a.commit()
    assert sorted(tdgather.open(mem)) == ["a.mp4", "b.mp4"]
    with pytest.raises(OutputError, match=f"another run committed a dataset there.*run {a.run}'s"):
        b.commit()
    ds = tdgather.open(mem)  # a's dataset, whole
    assert sorted(ds) == ["a.mp4", "b.mp4"] and ds.verify() == 1


def test_a_missing_bucket_is_named_before_any_frame_moves(s3):
    with pytest.raises(OutputError, match="the bucket 'no-such-bucket' does not exist"):
        tdgather.Collector("s3://no-such-bucket/preds", storage_options=s3).open()
    with pytest.raises(OutputError, match="the bucket 'no-such-bucket' does not exist"):
        tdgather.open("s3://no-such-bucket/preds", storage_options=s3)


@pytest.mark.parametrize(
    "name, data",
    [
        ("shard-00000.safetensors", b"not a shard, my own file"),
        ("shard-00007.abcdefabcdef-1.safetensors", b"mine too"),
        (INCOMPLETE_NAME, b'{"mine": 1}'),
    ],
)
def test_an_object_named_like_ours_but_not_ours_is_never_removed(mem, name, data):
    fs = fsspec.filesystem("memory")
    key = mem.removeprefix("memory://") + "/" + name
    fs.pipe_file(key, data)
    with pytest.raises(OutputError, match=f"holds '{name}', named like tdgather's files but not one tdgather wrote"):
        tdgather.save(frames(1.0), mem, overwrite=True)
    assert fs.cat_file(key) == data


def test_dataloader_workers_read_an_s3_dataset_with_fork_and_spawn(s3, url):
    """fsspec's async filesystems are not fork-safe: a forked worker makes its own."""
    from torch.utils.data import DataLoader

    from tdgather.storage.views import collate_frames

    tdgather.save(frames(1.0, names=[f"v{i}.mp4" for i in range(4)]), url, storage_options=s3)
    ds = tdgather.open(url, storage_options=s3)
    ds["v0.mp4"]  # the parent has used its filesystem (and its event loop) before the workers start
    for method in ("fork", "spawn"):
        loader = DataLoader(
            ds.per_frame(), batch_size=4, num_workers=2, collate_fn=collate_frames, multiprocessing_context=method
        )
        got = [b for b in loader]
        assert sorted((n, int(i)) for b in got for n, i in zip(b["filename"], b["frame_idx"], strict=True)) == sorted(
            (f"v{v}.mp4", i) for v in range(4) for i in range(3)
        ), method


def test_bad_storage_options_and_a_missing_backend_say_what_to_fix(s3):
    with pytest.raises(ValueError, match="storage_options=\\['endpoint'\\]: a key the s3:// filesystem does not take"):
        tdgather.open("s3://bucket/x", storage_options={"endpoint": s3["endpoint_url"]})
    with pytest.raises(
        OutputError,
        match="(listing the prefix|reading tdgather.index.json) failed .* check the URL and storage_options",
    ):
        tdgather.open("s3://bucket/x", storage_options={**s3, "endpoint_url": "http://127.0.0.1:1"})


def test_a_multipart_upload_is_whole_or_absent(s3, url):
    """Parts upload several at a time; the object appears once complete; an error mid-stream leaves nothing."""
    from tdgather.storage.objects import ObjectStore
    from tdgather.storage.store import digest

    store = ObjectStore(url, s3, block_bytes=5 << 20)  # S3's smallest part: 23 MiB make 5 parts
    data = torch.randint(0, 256, (23 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    chunks = [memoryview(data[i : i + (3 << 20)].numpy()) for i in range(0, data.numel(), 3 << 20)]
    written = store.put("shard-00000.safetensors", iter(chunks))
    assert store.read("shard-00000.safetensors") == data.numpy().tobytes()
    read = digest(store, "shard-00000.safetensors")
    assert written.size == read.size == 23 << 20 and written.sha256 == read.sha256

    def failing():
        yield from chunks[:4]  # 12 MiB: two parts sent
        raise RuntimeError("the frames' source failed")

    with pytest.raises(RuntimeError, match="source failed"):
        store.put("shard-00001.safetensors", failing())
    assert store.size("shard-00001.safetensors") is None
    fs = s3fs_of(s3)
    assert not fs.call_s3("list_multipart_uploads", Bucket=url.split("/")[2]).get("Uploads")  # aborted


def test_a_commit_is_conditional_on_s3_if_match(s3, url):
    """Two runs over one complete dataset (If-Match on its ETag): the first commits, the second is refused."""
    from tdgather.storage.writer import DatasetWriter

    tdgather.save(frames(1.0), url, storage_options=s3)
    a = DatasetWriter(url, overwrite=True, storage_options=s3)
    b = DatasetWriter(url, overwrite=True, storage_options=s3)
    a.write(frames(2.0))
    b.write(frames(3.0, names=("c.mp4",)))
    a.commit()
    with pytest.raises(OutputError, match=f"another run committed.*run {a.run}'s"):
        b.commit()
    ds = tdgather.open(url, storage_options=s3)
    assert sorted(ds) == ["a.mp4", "b.mp4"] and ds.verify() == len(ds.index["shards"])
    assert torch.equal(ds["a.mp4"].frames["depth"], torch.full((3, 4), 2.0))


def test_two_jobs_on_one_prefix_one_commits_whole_the_other_names_it(s3, url, tmp_path):
    """A requeued job (B, overwrite=True) starts while the first (A) still runs and has uploaded a shard."""
    import threading

    first: dict = {}

    def job_a():
        try:
            first["a"] = run_local_world(rc.case_job, 2, url, "alpha", str(tmp_path), s3, True, timeout=150)
        except WorldError as e:
            first["a"] = e

    t = threading.Thread(target=job_a, daemon=True)
    t.start()
    faults._wait_until((tmp_path / "alpha-open").exists, "job A's first shard", timeout=120)
    b = run_local_world(rc.case_job, 2, url, "beta", str(tmp_path), s3, False, timeout=150)
    listed = set(tdgather.open(url, storage_options=s3).index["shards"])
    a_shards = [n for n in objects(s3, url) if SHARD_NAME.fullmatch(n) and n not in listed]
    assert a_shards  # B's commit left the shards of A, the run that opened before it and still runs
    (tmp_path / "go").touch()
    t.join(150)
    assert b == [{"type": None}, {"type": None}]
    ds = tdgather.open(url, storage_options=s3)  # B's dataset, whole: every listed shard is there
    assert sorted(ds) == ["beta_0.mp4", "beta_1.mp4"] and ds.verify() == len(ds.index["shards"])
    assert all(ds[n].frame_idx.tolist() == list(range(8)) for n in ds)
    a = first["a"]
    assert a[0]["type"] == "OutputError" and f"run {ds.metadata['run']}" in a[0]["message"], a
    assert "another run committed a dataset there" in a[0]["message"] and "nothing of this run" in a[0]["message"]
    assert a[1]["type"] == "PeerError" and a[1]["rank"] == 0


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_run_killed_at_open_is_continued_by_resume_not_the_dataset_it_replaced(s3, url, tmp_path, where):
    """Yesterday's dataset at OUT; today's run (overwrite=True) killed before any shard; then resume=True."""
    out, opts = (str(tmp_path / "ds"), None) if where == "local" else (url, s3)
    tdgather.save(frames(1.0), out, storage_options=opts)
    yesterday = tdgather.open(out, storage_options=opts).metadata["run"]
    with pytest.raises(WorldError):
        run_local_world(rc.case_job, 2, out, "today", str(tmp_path), opts, False, True, timeout=150)
    assert sorted(tdgather.open(out, storage_options=opts)) == ["a.mp4", "b.mp4"]  # still yesterday's, whole
    assert run_local_world(rc.case_job, 2, out, "resume", str(tmp_path), opts, False, timeout=150)[0] == {"type": None}
    ds = tdgather.open(out, storage_options=opts)  # the interrupted run, finished: today's frames
    assert sorted(ds) == ["resume_0.mp4", "resume_1.mp4"] and ds.metadata["run"] != yesterday
    assert ds.verify() == len(ds.index["shards"]) if where == "s3" else len(ds.index["shards"]) > 0
    for name in ds:
        assert ds[name].frame_idx.tolist() == list(range(8))


def test_resume_beside_a_bare_partial_directory_keeps_the_complete_dataset(tmp_path):
    out = tmp_path / "ds"
    tdgather.save(frames(1.0), out)
    (tmp_path / "ds.partial").mkdir()  # what `mkdir` or a run killed before writing its mark leaves
    with tdgather.Collector(out, resume=True, progress=False) as col:
        assert sorted(col.saved) == ["a.mp4", "b.mp4"]
    ds = tdgather.open(out)
    assert sorted(ds) == ["a.mp4", "b.mp4"] and all((out / n).is_file() for n in ds.index["shards"])
    assert torch.equal(ds["a.mp4"].frames["depth"], torch.full((3, 4), 1.0))


@pytest.mark.parametrize(
    "run", ["../../zz/evil", "A" * 32, "1234", 7], ids=["a-path", "upper-case", "short", "not-a-string"]
)
def test_a_run_mark_edited_by_hand_is_refused_before_it_names_a_shard(mem, run):
    """The mark's run id names shards: anything but the hex id tdgather writes is refused, nothing is changed."""
    tdgather.save(frames(1.0), mem)
    fs = fsspec.filesystem("memory")
    mark = {"format": "tdgather", "run": run, "overwrite": True, "opened": 0.0, "host": "h", "pid": 1}
    fs.pipe_file(mem.removeprefix("memory://") + "/" + RUN_NAME, json.dumps(mark).encode())
    with pytest.raises(DatasetError, match=f"{RUN_NAME}: run: expected"):
        tdgather.Collector(mem, resume=True, progress=False).open()
    assert sorted(tdgather.open(mem)) == ["a.mp4", "b.mp4"]  # the complete dataset, as it was
