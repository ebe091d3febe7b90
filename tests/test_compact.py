"""Compaction and expiry of a dataset that jobs append to (`tdgather.compact`, `tdgather.expire`).

Compaction rewrites the newest snapshot's frames into new shards as the next snapshot: every frame
bit for bit, the schema unchanged, the earlier snapshots still reading as committed; a job that
commits while it runs keeps its frames; of two compactions of one snapshot one commits. Expiry
removes snapshots superseded longer than ``older_than`` and the shards only they list: never the
newest, never a shard a kept snapshot lists, never a running job's shards unless asked; a reader
left on an expired snapshot is told so; an expiry killed half way is finished by the next.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tdgather
from tdgather.errors import DatasetError, OutputError
from tdgather.format.names import snapshot_name
from tdgather.storage.location import store_at
from tdgather.storage.store import LocalStore
from tdgather.storage.writer import DatasetWriter
from tdgather.tools.cli import main

from .cases import assert_same_value


def value(name: str, idx: int) -> dict[str, Any]:
    """Frame ``idx`` of ``name``: boxes of 0 to 3 rows, a score, tokens of a length per filename, a label."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{idx}".encode()))
    return {
        "boxes": torch.rand(idx % 4, 4, generator=g),
        "score": torch.rand((), generator=g, dtype=torch.float64),
        "tokens": torch.arange(len(name) % 3 + 2) + idx,
        "label": f"{name}#{idx}",
    }


def share(job: int) -> dict[str, list]:
    """Job ``job``'s frames: 6 of "a" and "b" overlapping its neighbours', 2 of a filename of its own."""
    preds: dict[str, list] = {name: [(i, value(name, i)) for i in range(3 * job, 3 * job + 6)] for name in "ab"}
    preds[f"own-{job}"] = [(0, value(f"own-{job}", 0)), (5, value(f"own-{job}", 5))]
    return preds


def append(path: Any, job: int, **kw: Any) -> None:
    tdgather.save(tdgather.gather(share(job)), path, append=True, **kw)


def contents(ds: tdgather.Dataset) -> dict[tuple[str, int], Any]:
    """Every frame of ``ds``, each once."""
    out = {}
    for name in ds:
        clip = ds[name]
        idx = clip.frame_idx.tolist()
        assert idx == sorted(set(idx)), (name, idx)
        out.update(((name, i), clip.frames[k]) for k, i in enumerate(idx))
    assert len(out) == ds.metadata["total_frames"] and len(ds) == ds.metadata["num_filenames"]
    return out


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert_same_value(got[key], want[key], str(key))


def expected(jobs: range) -> dict[tuple[str, int], Any]:
    return {(name, i): value(name, i) for job in jobs for name, items in share(job).items() for i, _ in items}


def files(path: Path) -> set[str]:
    return set(os.listdir(path))


@pytest.fixture
def four(tmp_path) -> Path:
    """A dataset four jobs appended to, their shares overlapping: snapshots 1-4, four shards."""
    path = tmp_path / "ds"
    for job in range(4):
        append(path, job)
    return path


def test_compaction_rewrites_every_frame_into_one_shard_and_keeps_the_schema(four):
    before = tdgather.open(four)
    old = {v: contents(tdgather.open(four, version=v)) for v in range(1, 5)}
    snap = tdgather.compact(four)
    assert (snap.version, snap.compacted, snap.added, snap.duplicates_dropped) == (5, 4, 0, 0)
    assert (snap.frames, snap.filenames) == (before.metadata["total_frames"], len(before))
    ds = tdgather.open(four)
    assert ds.index["snapshot"]["compacted"] == 4 and len(ds.index["shards"]) == 1
    assert all(len(ds.index["files"][n]["segments"]) == 1 for n in ds)  # "a": four jobs' segments, now one
    assert ds.schema == before.schema and ds.ragged_leaves == before.ragged_leaves
    assert ds.metadata["duplicates_dropped"] == before.metadata["duplicates_dropped"] == 18
    assert_same(contents(ds), expected(range(4)))
    # the dropped copies' rows are gone: one shard smaller than the four were together
    size = lambda d: sum(e["size"] for e in d.index["shards"].values())  # noqa: E731
    assert size(ds) < size(before) and ds.metadata["total_bytes"] <= before.metadata["total_bytes"]
    for v, frames in old.items():  # nothing removed: each earlier snapshot reads as it was committed
        assert_same(contents(tdgather.open(four, version=v)), frames)
    assert [s.compacted for s in tdgather.snapshots(four)] == [None] * 4 + [4]


def test_compaction_keeps_a_tensorclass_and_a_schema_declared_fixed(tmp_path):
    path = tmp_path / "ds"
    frames = {
        f"p{n}": tdgather.Frames(torch.tensor([0]), {"tokens": torch.arange(n)[None], "mask": torch.ones(1, 2, 2)})
        for n in (5, 7)
    }
    with tdgather.Collector(path, ragged=False, progress=False) as col:  # one run: two types, not ragged
        for name, f in frames.items():
            col.add([name], f.frame_idx, f.frames)
    append(path, 0)  # then a job appends frames of other filenames (snapshot 1)
    before = tdgather.open(path)
    tdgather.compact(path)
    ds = tdgather.open(path)
    assert ds.schema == before.schema
    assert [str(ds.layout(f"p{n}").leaves[1].shape) for n in (5, 7)] == [
        str(before.layout(f"p{n}").leaves[1].shape) for n in (5, 7)
    ]
    assert_same(contents(ds), contents(before))


class RacingStore(LocalStore):
    """A directory whose first snapshot write runs ``before`` first: another job commits in between."""

    def __init__(self, root: Path, before: Any) -> None:
        super().__init__(root)
        self.before, self.tries = before, []

    def put_if(self, name: str, data: bytes, expected: str | None) -> bool:
        self.tries.append(name)
        if self.before is not None:
            before, self.before = self.before, None
            before()
        return super().put_if(name, data, expected)


def test_a_job_that_commits_while_a_compaction_runs_keeps_its_frames(four):
    store = RacingStore(four, lambda: append(four, 4))  # job 4 commits snapshot 5 as the compaction commits
    snap = tdgather.compact(four, store=store)
    assert store.tries == [snapshot_name(5), snapshot_name(6)] and snap.version == 6 and snap.compacted == 4
    ds = tdgather.open(four)
    assert_same(contents(ds), expected(range(5)))
    job4 = tdgather.snapshots(four)[4].run[:12]
    assert len(ds.index["shards"]) == 2 and any(job4 in s for s in ds.index["shards"])
    assert [s["shard"] for s in ds.index["files"]["b"]["segments"]][-1].split(".")[1].startswith(job4)


def test_of_two_compactions_of_one_snapshot_one_commits_and_the_other_leaves_nothing(four):
    store = RacingStore(four, lambda: tdgather.compact(four))
    with pytest.raises(OutputError, match="another compaction committed first. Nothing was committed"):
        tdgather.compact(four, store=store)
    snaps = tdgather.snapshots(four)
    assert [s.compacted for s in snaps] == [None] * 4 + [4]
    listed = set(tdgather.open(four).index["shards"]) | set(tdgather.open(four, version=4).index["shards"])
    assert {f for f in files(four) if f.startswith("shard-")} == listed  # the loser's shard removed
    assert_same(contents(tdgather.open(four)), expected(range(4)))


def test_a_dataset_written_plainly_is_compacted_as_snapshot_1(tmp_path):
    path = tmp_path / "ds"
    gathered = tdgather.gather(share(0))
    with tdgather.Collector(path, progress=False) as col:  # one run, many small shards
        for name, items in share(0).items():
            for i, v in items:
                col.add([name], [i], [v])
    before = contents(tdgather.open(path))
    snap = tdgather.compact(path, max_shard_bytes=200)
    assert snap.version == 1 and snap.compacted == 0
    assert_same(contents(tdgather.open(path)), before)
    assert_same(contents(tdgather.open(path, version=0)), before)
    assert len(tdgather.open(path).index["shards"]) > 1  # shards of at most 200 bytes (a filename whole)
    with pytest.raises(OutputError, match="is a dataset that jobs append to"):
        tdgather.save(gathered, path, overwrite=True)


def test_expiry_keeps_what_a_reader_may_use_and_removes_what_only_old_snapshots_list(four):
    tdgather.compact(four)
    append(four, 4)  # snapshot 6: the compacted shard and job 4's
    made = {s.version: datetime.fromisoformat(s.made) for s in tdgather.snapshots(four)}
    old_shards = set(tdgather.open(four, version=4).index["shards"])
    on_five = tdgather.open(four, version=5)
    # an hour later nothing was superseded more than 2 hours ago: nothing goes
    got = tdgather.expire(four, older_than=timedelta(hours=2), now=made[6] + timedelta(hours=1))
    assert (got.snapshots, got.shards, got.kept) == ((), (), (1, 2, 3, 4, 5, 6))
    # snapshots 1-4 superseded at 2-5's made; 5 at 6's: with older_than just past 5's supersession, 1-4 go
    now = made[6] + timedelta(seconds=1)
    dry = tdgather.expire(four, older_than=(now - made[5]).total_seconds() - 1e-3, now=now, dry_run=True)
    assert dry.snapshots == (1, 2, 3, 4) and set(dry.shards) == old_shards and dry.bytes > 0
    assert files(four) >= old_shards  # dry: nothing removed
    got = tdgather.expire(four, older_than=(now - made[5]).total_seconds() - 1e-3, now=now)
    assert got == dry and got.kept == (5, 6)
    assert not files(four) & old_shards and snapshot_name(4) not in files(four)
    assert_same(contents(tdgather.open(four)), expected(range(5)))
    assert_same(contents(on_five), expected(range(4)))  # kept: superseded less than older_than ago
    with pytest.raises(OutputError, match=r"no snapshot version=2 \(there are: 5, 6\)"):
        tdgather.open(four, version=2)
    assert [s.version for s in tdgather.snapshots(four)] == [5, 6]
    append(four, 5)  # appends go on: snapshot 7
    assert tdgather.snapshots(four)[-1].version == 7
    assert_same(contents(tdgather.open(four)), expected(range(6)))


def test_a_reader_left_on_an_expired_snapshot_is_told_to_open_again(four):
    reader = tdgather.open(four)  # snapshot 4, its shards not opened yet
    tdgather.compact(four)
    tdgather.expire(four, older_than=0)
    with pytest.raises(OutputError, match=r"of snapshot 4, which this Dataset reads, is gone.*newest snapshot, 5"):
        reader["a"]
    assert_same(contents(tdgather.open(four)), expected(range(4)))


def test_a_shard_missing_from_the_newest_snapshot_is_damage_not_expiry(four):
    ds = tdgather.open(four)
    (four / next(iter(ds.index["files"]["own-0"]["segments"]))["shard"]).unlink()
    with pytest.raises(DatasetError, match="no such file"):
        ds["own-0"]


def test_orphan_shards_go_only_when_asked(four):
    writer = DatasetWriter(four, append=True)  # a job that wrote a shard and never committed
    writer.write(tdgather.gather(share(9)))
    orphan = set(writer.report())  # once durable
    assert orphan <= files(four)
    got = tdgather.expire(four, older_than=0)
    assert got.snapshots == (1, 2, 3) and got.shards == () and orphan <= files(four)  # appends list every shard
    got = tdgather.expire(four, older_than=0, orphans=True)
    assert got.snapshots == () and set(got.shards) == orphan and not orphan & files(four)
    with pytest.raises(OutputError, match="are not there"):  # that job, had it gone on, commits nothing
        writer.commit()
    assert_same(contents(tdgather.open(four)), expected(range(4)))


class FailingStore(LocalStore):
    """A directory whose ``remove`` fails after ``n`` removals (an expiry killed half way)."""

    def __init__(self, root: Path, n: int) -> None:
        super().__init__(root)
        self.n = n

    def remove(self, name: str) -> None:
        if self.n == 0:
            raise OSError("killed")
        self.n -= 1
        super().remove(name)


@pytest.mark.parametrize("n", [0, 2, 4, 5])
def test_an_expiry_killed_half_way_leaves_the_kept_snapshots_whole_and_the_next_finishes(four, n):
    tdgather.compact(four)
    listed = {v: set(tdgather.open(four, version=v).index["shards"]) for v in range(1, 6)}
    with pytest.raises(OSError, match="killed"):
        tdgather.expire(four, older_than=0, store=FailingStore(four, n))
    left = [s.version for s in tdgather.snapshots(four)]
    assert 5 in left
    assert_same(contents(tdgather.open(four)), expected(range(4)))
    for v in left:  # every snapshot still there lists only shards still there, or is expired (shards removed first)
        assert v != 5 or listed[5] <= files(four)
    got = tdgather.expire(four, older_than=0)
    assert got.kept == (5,) and [s.version for s in tdgather.snapshots(four)] == [5]
    assert {f for f in files(four) if f.startswith("shard-")} == listed[5]


def test_expiry_and_compaction_of_what_is_not_a_dataset_are_refused(tmp_path):
    with pytest.raises(OutputError, match="nothing to compact"):
        tdgather.compact(tmp_path)
    with pytest.raises(OutputError, match="nothing to expire"):
        tdgather.expire(tmp_path)
    with pytest.raises(ValueError, match="older_than: expected a duration >= 0"):
        tdgather.expire(tmp_path, older_than=-1)


def test_a_snapshot_whose_compacted_field_was_edited_by_hand_is_refused(four):
    tdgather.compact(four)
    f = four / snapshot_name(5)
    snap = json.loads(f.read_text())
    snap["snapshot"]["compacted"] = "four"
    f.write_text(json.dumps(snap))
    with pytest.raises(DatasetError, match="snapshot.compacted"):
        tdgather.open(four)
    with pytest.raises(DatasetError, match="snapshot.compacted"):
        tdgather.expire(four, older_than=0)
    assert len([n for n in files(four) if n.startswith("tdgather.snapshot")]) == 5  # nothing removed


def test_compaction_and_expiry_on_s3(s3, url):
    for job in range(3):
        append(url, job, storage_options=s3)
    before = tdgather.open(url, storage_options=s3)
    snap = tdgather.compact(url, s3)
    assert snap.version == 4 and snap.compacted == 3
    ds = tdgather.open(url, storage_options=s3)
    assert len(ds.index["shards"]) == 1 and ds.schema == before.schema
    assert_same(contents(ds), expected(range(3)))
    got = tdgather.expire(url, s3, older_than=0)
    assert got.snapshots == (1, 2, 3) and len(got.shards) == 3
    store = store_at(url, s3)
    assert sorted(store.list()) == sorted([*ds.index["shards"], snapshot_name(4)])
    assert_same(contents(tdgather.open(url, storage_options=s3)), expected(range(3)))
    with pytest.raises(OutputError, match="is gone"):
        before["a"]


def test_the_commands(four, capsys):
    assert main(["compact", str(four)]) == 0
    assert "snapshot 5: snapshot 4's" in capsys.readouterr().out
    assert main(["snapshots", str(four)]) == 0
    assert "compaction of 4: " in capsys.readouterr().out
    assert main(["expire", str(four), "--older-than", "0s", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("would remove 4 snapshot(s) [1-4] and 4 shard(s)") and "kept 1 snapshot(s) [5]" in out
    assert main(["expire", str(four), "--older-than", "7d"]) == 0
    assert capsys.readouterr().out.startswith("removed 0 snapshot(s) [] and 0 shard(s)")
    assert main(["expire", str(four), "--older-than", "0"]) == 0
    assert [s.version for s in tdgather.snapshots(four)] == [5]
    assert_same(contents(tdgather.open(four)), expected(range(4)))
    with pytest.raises(SystemExit):
        main(["expire", str(four), "--older-than", "soon"])


def test_a_snapshot_whose_duplicate_counts_were_edited_by_hand_stops_the_next_commit_naming_them(four):
    f = four / snapshot_name(4)
    snap = json.loads(f.read_text())
    snap["metadata"]["duplicates"] = {"exact": "many"}
    f.write_text(json.dumps(snap))
    with pytest.raises(DatasetError, match="metadata.duplicates: expected {exact, inexact, max_abs_diff}"):
        append(four, 4)
    assert [s.version for s in tdgather.snapshots(four)] == [1, 2, 3, 4]


def test_jobs_commit_while_a_loop_compacts_and_expires_everything_at_once(tmp_path):
    """``older_than=0`` removes what a committing job is reading: its commit reads the newest again."""
    path = tmp_path / "ds"
    append(path, 0)
    stop, errors = threading.Event(), []

    def maintain() -> None:
        while not stop.is_set():
            try:
                tdgather.compact(path)
                tdgather.expire(path, older_than=0)
            except BaseException as e:  # reported below
                errors.append(e)
                return

    t = threading.Thread(target=maintain)
    t.start()
    try:
        for job in range(1, 8):
            append(path, job)
    finally:
        stop.set()
        t.join(120)
    assert not errors, errors[0]
    assert_same(contents(tdgather.open(path)), expected(range(8)))
    assert sum(s.compacted is None for s in tdgather.snapshots(path)) <= 8  # expired: only the newest few left


def test_orphans_go_only_if_tdgather_wrote_them_and_with_killed_writes_temporaries(four):
    stray = four / "shard-00099.safetensors"
    stray.write_bytes(b"not a shard")
    with pytest.raises(OutputError, match="named like a shard but not one tdgather wrote"):
        tdgather.expire(four, older_than=0, orphans=True)
    assert stray.exists() and [s.version for s in tdgather.snapshots(four)] == [1, 2, 3, 4]  # nothing removed
    stray.unlink()
    temp = four / ".shard-00000.0123456789ab-1.safetensors.tmp-123456"  # a write killed before its rename
    temp.write_bytes(b"half a shard")
    got = tdgather.expire(four, older_than=timedelta(days=1), orphans=True)
    assert got.shards == (temp.name,) and got.bytes == 12 and not temp.exists()


def test_what_compact_expire_and_open_refuse(four, tmp_path):
    with pytest.raises(ValueError, match="max_shard_bytes: expected an int >= 1, got 0"):
        tdgather.compact(four, max_shard_bytes=0)
    with pytest.raises(TypeError, match="version: expected a snapshot number"):
        tdgather.open(four, version="2")
    assert len(tdgather.open(four, version=np.int64(2))) == 4  # a numpy integer is a number: a, b, own-0, own-1
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file, not a dataset directory"):
        append(tmp_path / "file", 0)


def test_an_export_of_an_expired_snapshot_is_told_to_open_again(four):
    pytest.importorskip("datasets")
    reader = tdgather.open(four)
    tdgather.compact(four)
    tdgather.expire(four, older_than=0)
    with pytest.raises(OutputError, match="is gone"):
        reader.to_hf()


def test_compacting_again_with_nothing_committed_since_writes_nothing(four):
    first = tdgather.compact(four)
    listing = files(four)
    assert tdgather.compact(four) == first and files(four) == listing
    append(four, 4)
    assert tdgather.compact(four).compacted == 6
