"""One dataset from many writers (`Collector(ranks_per_writer=k)`, `tdgather.format.blocks`), in real gloo worlds.

Every multi-writer dataset is compared bit for bit with what one writer (rank 0) writes from the
same frames: through `tdgather.open`, through plain safetensors following the index, and in the
index's totals and duplicate counts.
"""

import json
import os
import threading
from pathlib import Path

import pytest
import torch

import tdgather
from tdgather.core.ragged import Ragged
from tdgather.errors import OutputError, ProtocolError
from tdgather.format.blocks import check_report, check_run
from tdgather.storage.writer import DatasetWriter
from tdgather.tools.launch import WorldError, run_local_world

from . import cases
from . import resume_cases as rc
from . import writers_cases as wc
from .procs import kill_later
from .test_resume import assert_same_dataset, attempt

pytestmark = pytest.mark.world
WORLD = 4


def run(out: Path, k: int | None, scenario: str, world: int = WORLD, shard_bytes: int = 1 << 30) -> list:
    return run_local_world(wc.case_writers, world, str(out), k, scenario, "keep", shard_bytes, timeout=180)


def assert_same_as_one_writer(got: Path, want: Path) -> None:
    a, b = tdgather.open(got), tdgather.open(want)
    assert list(a) == list(b) and len(b) > 0
    for name in b:
        assert torch.equal(a[name].frame_idx, b[name].frame_idx), name
        cases.assert_same_value(a[name].frames, b[name].frames, name)
    pa, pb = cases.plain_read(got), cases.plain_read(want)
    assert pa.keys() == pb.keys()
    for name in pb:
        assert [i for i, _ in pa[name]] == [i for i, _ in pb[name]], name
        for (_, x), (_, y) in zip(pa[name], pb[name], strict=True):
            assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True)), name
    for key in ("total_frames", "total_bytes", "num_filenames", "duplicates", "duplicates_dropped"):
        assert a.metadata[key] == b.metadata[key], key


@pytest.mark.parametrize("scenario", ["split+dup", "padded", "uneven", "nested"])
@pytest.mark.parametrize("k", [2, 3])
def test_many_writers_write_the_single_writer_dataset(tmp_path, scenario, k):
    many = run(tmp_path / "many", k, scenario)
    one = run(tmp_path / "one", None, scenario)
    assert [r is None for r in many] == [False, True, True, True]  # the summary is rank dst's
    assert many[0] == one[0]  # frames, frames per rank, duplicates
    assert_same_as_one_writer(tmp_path / "many", tmp_path / "one")
    ds = tdgather.open(tmp_path / "many")
    assert ds.index["version"] == 8 and tdgather.open(tmp_path / "one").index["version"] == 8  # checksums
    assert all(type(entry["crc32"]) is int for entry in ds.index["shards"].values())  # as each writer wrote it
    assert ds.verify() == len(ds.index["shards"])
    writers = {name.split("-")[1] for name in ds.index["shards"]}
    assert writers == {"00000", "00001"}  # blocks 0-1 and 2-3 (k=2), or 0-2 and 3 (k=3)
    assert sorted(os.listdir(tmp_path)) == ["many", "one"]  # published: no .partial left
    if scenario == "padded":
        assert many[0]["dups"]["inexact"] > 0  # padded copies from other ranks, dropped across writers


def test_eight_writers_in_a_sixteen_rank_world(tmp_path):
    out = run(tmp_path / "ds", 2, "split+dup", world=16)
    ds = tdgather.open(tmp_path / "ds")
    assert {name.split("-")[1] for name in ds.index["shards"]} == {f"{w:05d}" for w in range(8)}
    expected = cases.reference([wc.predictions("split+dup", r, 16) for r in range(16)])
    cases.assert_matches({name: ds[name] for name in ds}, expected)
    assert out[0]["dups"]["exact"] == 2 and sum(out[0]["per_rank"].values()) == out[0]["frames"] + 2
    assert len(ds["long.mp4"].frame_idx) == 40 and len(ds.index["files"]["long.mp4"]["segments"]) == 8


def test_a_writer_with_a_small_shard_limit_writes_many_shards(tmp_path):
    run(tmp_path / "many", 2, "padded", shard_bytes=200)
    run(tmp_path / "one", None, "padded")
    assert len(tdgather.open(tmp_path / "many").index["shards"]) > 8
    assert_same_as_one_writer(tmp_path / "many", tmp_path / "one")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The resume cases' uninterrupted run, one writer."""
    out = tmp_path_factory.mktemp("ref") / "ds"
    attempt(out, resume=False)
    return out


def writers_attempt(out: Path, resume: bool, kill: dict | None = None, k: int | None = 2) -> list:
    """One attempt of the resume cases in a 4-rank world with a writer per 2 ranks; ``kill`` as there."""
    args = (rc.case_run, WORLD, str(out), resume, kill, 4, "same", k)
    if kill is None:
        return run_local_world(*args, timeout=120)
    with pytest.raises(WorldError) as e:
        run_local_world(*args, timeout=120)
    assert e.value.failures[kill["rank"]] == "exited with code -9 and no result", e.value.failures
    return e.value.results


def test_a_rank_of_the_second_writer_killed_then_resumed(tmp_path, reference):
    out = tmp_path / "ds"
    writers_attempt(out, resume=False, kill={"rank": 3, "batch": 3})
    assert not out.exists()  # no index, nothing published
    names = os.listdir(tmp_path / "ds.partial")
    assert {n.split("-")[1] for n in names if n.startswith("shard-")} == {"00000", "00001"}
    saved = tdgather.open(out, incomplete=True)  # every writer's shards, from their own records
    assert 0 < saved.metadata["total_frames"] < 87
    record = json.loads((tmp_path / "ds.partial" / "tdgather.incomplete.json").read_text())["metadata"]
    assert record["failure"]["rank"] in (2, 3) and "3" in record["failure"]["message"]
    writers_attempt(out, resume=True)
    assert_same_dataset(out, reference)
    a = tdgather.open(out).metadata["attempts"]
    assert [x["attempt"] for x in a] == [1, 2] and sum(x["frames"] for x in a) == 87


def test_a_writer_killed_while_writing_then_resumed_by_one_writer(tmp_path, reference):
    out = tmp_path / "ds"
    writers_attempt(out, resume=False, kill={"rank": 2, "write": 2})
    names = os.listdir(tmp_path / "ds.partial")
    assert any(n.startswith("shard-00001-") for n in names) and any(".tmp-" in n for n in names)
    writers_attempt(out, resume=True, k=None)  # the resumed attempt may change the writers
    assert_same_dataset(out, reference)


def test_the_coordinator_killed_while_writing_then_resumed_twice(tmp_path, reference):
    out = tmp_path / "ds"
    writers_attempt(out, resume=False, kill={"rank": 0, "write": 2})
    writers_attempt(out, resume=True, kill={"rank": 1, "batch": 1})
    writers_attempt(out, resume=True)
    assert_same_dataset(out, reference)
    a = tdgather.open(out).metadata["attempts"]
    assert [x["attempt"] for x in a] == [1, 2, 3] and a[0]["failure"]["type"] == "Unrecorded"


def report(out: Path, k: int | None, scenario: str, duplicates: str = "keep") -> list:
    return run_local_world(wc.case_writers_reporting, WORLD, str(out), k, scenario, duplicates, timeout=120)


def test_copies_that_differ_across_writers_follow_the_policy(tmp_path):
    refused = report(tmp_path / "exact", 2, "far_conflict", "exact")
    assert all(r.get("type") for r in refused), refused
    assert refused[0]["type"] == "DuplicateFrameError" and "'x.mp4', frame_idx 1" in refused[0]["message"]
    assert not (tmp_path / "exact").exists()
    kept = tdgather.open(tmp_path / "exact", incomplete=True)["x.mp4"]  # what was saved stays readable
    assert torch.equal(kept.frames[1], cases.value("x.mp4", 1))  # the lowest writer's copy
    ok = report(tmp_path / "keep", 2, "far_conflict", "keep")
    assert ok[0]["ok"]["dups"]["inexact"] == 1 and ok[0]["ok"]["dups"]["exact"] == 2
    assert torch.equal(tdgather.open(tmp_path / "keep")["x.mp4"].frames[1], cases.value("x.mp4", 1))


def test_one_filename_with_two_layouts_in_two_writers_is_named(tmp_path):
    out = report(tmp_path / "ds", 2, "far_shape")
    assert out[0]["type"] == "ShapeMismatchError", out
    assert "'x.mp4'" in out[0]["message"] and "[3]" in out[0]["message"] and "[3, 4]" in out[0]["message"]
    assert all(r.get("type") for r in out) and not (tmp_path / "ds").exists()


def test_rank_dst_must_be_a_writer(tmp_path):
    out = run_local_world(wc.case_writers_reporting, WORLD, str(tmp_path / "ds"), 3, "uneven", "keep", timeout=60)
    assert all("ok" in r for r in out)  # dst 0 is a multiple of 3
    # a dst that is not a writer: tests/test_dst.py
    with pytest.raises(ValueError, match="ranks_per_writer"):
        tdgather.Collector(tmp_path / "x", ranks_per_writer=0)


def test_ranks_that_disagree_on_the_writers_fail_and_do_not_hang(tmp_path):
    out = run_local_world(wc.case_mismatched_writers, WORLD, str(tmp_path / "ds"), timeout=120)
    assert all(r["type"] for r in out), out
    assert any("Collector(ranks_per_writer=2)" in r["message"] for r in out), out


@pytest.mark.parametrize(
    "report, field",
    [
        (None, "done.report"),
        ({"shards": [], "frames_per_rank": [], "duplicates": {}}, "done.report.shards"),
        ({"shards": {"../x": {}}, "frames_per_rank": [], "duplicates": {}}, "done.report.shards['../x']"),
        ({"shards": {"shard-00000-00000.safetensors": {}}, "frames_per_rank": [], "duplicates": {}}, "shards["),
        (
            {"shards": {"shard-00001-00000.safetensors": {"frames": 1, "bytes": 1, "size": "x"}}},
            "done.report",
        ),
        (
            {
                "shards": {"shard-00001-00000.safetensors": {"frames": 1, "bytes": 1, "size": -1, "sha256": "0" * 64}},
                "frames_per_rank": [],
                "duplicates": {"exact": 0, "inexact": 0, "max_abs_diff": 0},
            },
            "size",
        ),
        (
            {
                "shards": {"shard-00001-00000.safetensors": {"frames": 1, "bytes": 1, "size": 9, "sha256": "../x"}},
                "frames_per_rank": [],
                "duplicates": {"exact": 0, "inexact": 0, "max_abs_diff": 0},
            },
            "sha256",
        ),
        (
            {"shards": {}, "frames_per_rank": [[1]], "duplicates": {"exact": 0, "inexact": 0, "max_abs_diff": 0}},
            "frames_per_rank[0]",
        ),
        (
            {"shards": {}, "frames_per_rank": [], "duplicates": {"exact": 0, "inexact": 0, "max_abs_diff": "nan"}},
            "max_abs_diff",
        ),
    ],
)
def test_a_malformed_report_from_a_writer_is_refused(report, field):
    with pytest.raises(ProtocolError) as e:
        check_report(report, 2, 1)
    assert e.value.rank == 2 and field in str(e.value)


def test_a_report_and_a_run_as_sent_are_accepted():
    report = {
        "shards": {"shard-00001-00003.safetensors": {"frames": 4, "bytes": 64, "size": 900, "sha256": "0" * 64}},
        "frames_per_rank": [[2, 3], [3, 1]],
        "duplicates": {"exact": 1, "inexact": 0, "max_abs_diff": "inf"},
    }
    assert check_report(report, 2, 1) == report
    assert check_run({"id": "ab12", "attempt": 2}, 0) == ("ab12", 2)
    for bad in ({"id": "", "attempt": 1}, {"id": "a", "attempt": 0}, {"id": "a"}, ["a", 1]):
        with pytest.raises(ProtocolError):
            check_run(bad, 0)


def test_a_writer_that_cannot_see_the_output_says_it_must_be_shared(tmp_path):
    with pytest.raises(OutputError, match="filesystem all of them share"):
        DatasetWriter(tmp_path / "ds", writer=1, joins=("run", 1))


def test_a_shard_reported_but_not_seen_by_the_coordinator_fails_the_run(tmp_path):
    w = DatasetWriter(tmp_path / "ds", writer=0)
    w.write({"a": tdgather.Frames(frame_idx=torch.arange(2), frames=torch.zeros(2, 3), batch_size=[2])})
    part = DatasetWriter(tmp_path / "ds", writer=1, joins=(w.run, w.attempt))
    part.write({"b": tdgather.Frames(frame_idx=torch.arange(2), frames=torch.ones(2, 3), batch_size=[2])})
    shards = part.report()
    assert w.combine({1: shards}).dropped == 0 and sorted(w.files) == ["a", "b"]
    name = next(iter(shards))
    with pytest.raises(OutputError, match="one every writer reaches \\(a shared filesystem"):
        w.combine({1: {**shards, name: {**shards[name], "size": shards[name]["size"] + 1}}})
    w.commit()
    ds = tdgather.open(tmp_path / "ds")
    assert sorted(ds) == ["a", "b"] and torch.equal(ds["b"].frames, torch.ones(2, 3))


@pytest.mark.parametrize("slow", [0, 1, 2, 3])  # the coordinator, its sender, the other writer, that one's sender
def test_blocks_that_finish_many_timeouts_apart_complete(tmp_path, slow):
    out = run_local_world(wc.case_far_apart, WORLD, str(tmp_path / "ds"), slow, 6.0, 1.0, timeout=120)
    assert out[0]["frames"] == 12
    assert all(r["waited"] >= 5.5 for r in out)  # everyone waited through 6 timeouts of 1 s, and nobody failed


def test_a_writer_that_does_not_see_the_output_fails_every_rank_at_the_with_line(tmp_path):
    out = run_local_world(wc.case_writer_without_the_output, WORLD, str(tmp_path / "ds"), timeout=120)
    assert out[2]["type"] == "OutputError" and "filesystem all of them share" in out[2]["message"]
    assert out[0]["type"] == "PeerError" and out[0]["rank"] == 2 and "OutputError" in out[0]["message"]
    assert out[3]["type"] == "PeerError" and out[3]["rank"] == 2  # its writer's answer
    assert out[1]["type"] == "PeerError" and out[1]["rank"] == 0
    assert not (tmp_path / "ds").exists()


def test_ragged_copies_across_writers_are_dropped_with_their_bytes(tmp_path):
    def frames(idx):
        boxes = Ragged.from_list([torch.full((j % 3 + 1, 4), float(j)) for j in idx])
        value = {"boxes": boxes, "score": torch.tensor([float(j) for j in idx])}
        return tdgather.Frames(frame_idx=torch.tensor(idx), frames=value, batch_size=[len(idx)])

    w0 = DatasetWriter(tmp_path / "many", writer=0)
    w0.write({"f": frames([0, 1, 2, 3])})
    w1 = DatasetWriter(tmp_path / "many", writer=1, joins=(w0.run, w0.attempt))
    w1.write({"f": frames([2, 3, 4, 5])})
    assert w0.combine({1: w1.report()}).exact == 2
    w0.commit()
    tdgather.save({"f": frames([0, 1, 2, 3, 4, 5])}, tmp_path / "one")
    many, one = tdgather.open(tmp_path / "many"), tdgather.open(tmp_path / "one")
    assert torch.equal(many["f"].frame_idx, torch.arange(6))
    a, b = many["f"].frames, one["f"].frames
    assert torch.equal(a["boxes"].values(), b["boxes"].values()) and torch.equal(a["score"], b["score"])
    assert torch.equal(a["boxes"].offsets(), b["boxes"].offsets())
    assert many.metadata["total_bytes"] == one.metadata["total_bytes"]  # the dropped copies' boxes not counted
    assert many.index["shards"]["shard-00001-00000.safetensors"]["frames"] == 2  # 4 rows, 2 listed


def test_writers_with_nothing_to_write(tmp_path):
    assert run(tmp_path / "empty", 2, "all_empty")[0]["frames"] == 0
    assert len(tdgather.open(tmp_path / "empty")) == 0  # an empty dataset, as with one writer
    run(tmp_path / "many", 2, "zero_rank")  # rank 1, in the first block, has no frames
    run(tmp_path / "one", None, "zero_rank")
    assert_same_as_one_writer(tmp_path / "many", tmp_path / "one")


def test_a_stopped_writer_fails_every_other_rank_within_the_timeout(tmp_path):
    out = str(tmp_path / "ds")
    killer = threading.Thread(target=kill_later, args=(out + ".pid", 10.0), daemon=True)
    killer.start()
    with pytest.raises(WorldError) as info:  # rank 2 stopped, then killed: it leaves no result
        run_local_world(wc.case_writer_stops, WORLD, out, 2.0, timeout=60)
    start = os.path.getmtime(out + ".pid")  # written by rank 2 just before it stopped: the world's own clock
    assert set(info.value.failures) == {2}
    r = info.value.results
    assert r[0]["type"] == "PeerLostError" and r[0]["rank"] == 2, r[0]  # the coordinator names the writer
    assert r[3]["type"] == "PeerLostError" and r[3]["rank"] == 2, r[3]  # and so does the writer's peer
    assert r[1]["type"] in ("PeerError", "PeerLostError") and r[1]["rank"] == 0, r[1]
    assert max(x["at"] for x in (r[0], r[1], r[3])) - start < 2.0 + 6.0  # the timeout and slack (not start-up)
    assert tdgather.open(out, incomplete=True).metadata["total_frames"] >= 2  # rank 0's and 1's frames kept


def test_the_coordinator_writes_its_own_frames_while_another_writer_still_runs(tmp_path):
    out = tmp_path / "ds"
    seen = run_local_world(wc.case_coordinator_writes_first, 2, str(out), 20.0, timeout=120)
    assert seen == [None, True]
    ds = tdgather.open(out)
    assert sorted(ds) == ["r0.jpg", "r1.jpg"] and ds["r1.jpg"].frames[0, 0].item() == 1
