"""The duplicates policy across jobs that append to one dataset (``append=True``, `tdgather.storage.append.merge`).

A frame the newest snapshot holds, sent again by a later job, is a copy that the later job's
``duplicates=`` decides, as copies within one job are: ``"keep"`` keeps the dataset's copy and
counts the job's (exact or inexact); ``"exact"`` and ``"close"`` count a copy they accept and refuse
one that differs, at the commit: `DuplicateFrameError` naming the filename, the frame and both
jobs, and nothing committed. Jobs run one after another in this process (a `Collector`, or
`tdgather.save` with a `DatasetWriter` that has a policy); the scheduler's job id comes from the
environment, as SLURM sets it.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import tdgather
from tdgather import DuplicateFrameError, DuplicatePolicy
from tdgather.storage.writer import DatasetWriter

from .cases import assert_same_value

RUN_IN_NAME = re.compile(r"shard-[0-9]{5}\.([0-9a-f]{12})-1\.safetensors")


def value(name: str, idx: int) -> torch.Tensor:
    """Frame ``idx`` of ``name``: exact in float32, so a copy ``+ d`` differs by exactly ``d``."""
    return torch.arange(3.0) + 10 * idx + len(name)


def boxes(idx: int) -> dict[str, torch.Tensor]:
    """A tree with a ragged leaf: 1 to 3 boxes, from ``idx`` alone."""
    return {"boxes": torch.arange(float(idx % 3 + 1) * 4).reshape(-1, 4) + idx, "score": torch.tensor(idx / 4)}


def save(preds: dict[str, list], path: Path, duplicates: Any = "keep") -> Any:
    """One job: ``preds`` gathered and appended by `tdgather.save`, through a `DatasetWriter` with ``duplicates``."""
    writer = functools.partial(DatasetWriter, duplicates=duplicates)
    return tdgather.save(tdgather.gather(preds), path, append=True, sink=writer)


def collect(path: Path, frames: dict[str, list], duplicates: Any = "keep") -> tdgather.CollectorSummary:
    """One job: a `Collector` that appends, one ``add`` per filename (``frames``: ``[(idx, value)]``)."""
    with tdgather.Collector(path, append=True, duplicates=duplicates, progress=False, log_summary=False) as col:
        for name, items in frames.items():
            col.add([name] * len(items), [i for i, _ in items], [v for _, v in items])
    return col.summary


def contents(path: Path) -> dict[tuple[str, int], Any]:
    """``{(filename, frame_idx): frame}`` of the newest snapshot, each frame there once; its shards verified."""
    ds = tdgather.open(path)
    out = {}
    for name in ds:
        idx = ds[name].frame_idx.tolist()
        assert len(set(idx)) == len(idx), f"{name}: a frame listed twice: {idx}"
        out.update(((name, i), ds[name].frames[row]) for row, i in enumerate(idx))
    assert len(out) == ds.metadata["total_frames"]
    ds.verify()
    return out


def state(path: Path) -> dict[str, bytes]:
    """Every snapshot and index of the dataset, by name: what a commit would change."""
    return {p.name: p.read_bytes() for p in sorted(path.glob("tdgather.*"))}


def unlisted_runs(path: Path) -> set[str]:
    """The runs (first 12 hex digits) of the shards on disk that the newest snapshot does not list."""
    listed = set(tdgather.open(path).index["shards"])
    return {RUN_IN_NAME.fullmatch(p.name)[1] for p in path.glob("shard-*.safetensors") if p.name not in listed}


def assert_values(got: dict[tuple[str, int], Any], want: dict[tuple[str, int], Any]) -> None:
    assert sorted(got) == sorted(want)
    for key, frame in want.items():
        assert_same_value(got[key], frame, f"{key}")


# ---------------------------------------------------------------- a copy refused


def test_exact_refuses_a_differing_copy_naming_both_jobs_and_commits_nothing(tmp_path, monkeypatch):
    path = tmp_path / "ds"
    first = {"a": [(i, value("a", i)) for i in range(4)], "b": [(0, value("b", 0))]}
    save(first, path)
    held = tdgather.snapshots(path)[-1].run[:12]
    before, kept = state(path), contents(path)

    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4242")  # as SLURM sets them for task 3 of an array
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    # frame 2 is bit-identical (accepted), frame 3 differs by 0.5 (refused), 4 and 5 are new
    sent = [(2, value("a", 2)), (3, value("a", 3) + 0.5), (4, value("a", 4)), (5, value("a", 5))]
    with pytest.raises(DuplicateFrameError) as raised:
        collect(path, {"a": sent, "c": [(0, value("c", 0))]}, duplicates="exact")

    (mine,) = unlisted_runs(path)  # the refused job's shard: there, listed by no snapshot
    assert mine != held
    message = str(raised.value)
    assert message.startswith("filename 'a', frame_idx 3: ")
    assert f"the job of run {held} (its commit holds the dataset's copy; shard shard-00000.{held}-1.safetensors)" in (
        message
    )
    assert f"this job (run {mine}, SLURM_ARRAY_JOB_ID=4242_3; shard shard-00000.{mine}-1.safetensors)" in message
    assert "largest absolute difference 0.5" in message and "the duplicates policy is 'exact'" in message
    assert f"`tdgather snapshots {path}` lists each snapshot with the run and the scheduler job" in message
    assert "Nothing of this job was committed" in message
    assert "duplicates='keep'" in message and "tdgather.saved_at(path).todo(items)" in message

    # the dataset is as it was: no snapshot added, the same frames, readable
    assert state(path) == before
    assert [s.version for s in tdgather.snapshots(path)] == [1]
    assert_values(contents(path), kept)

    # the fix: send only what the dataset lacks, with the same policy
    items = [("a", i) for i in range(2, 6)] + [("c", 0)]
    todo = tdgather.saved_at(path).todo(items)
    assert todo == [("a", 4), ("a", 5), ("c", 0)]
    collect(path, {"a": [(i, value("a", i)) for _, i in todo[:2]], "c": [(0, value("c", 0))]}, duplicates="exact")
    s2 = tdgather.snapshots(path)[-1]
    assert (s2.version, s2.added, s2.duplicates_dropped, s2.job) == (2, 3, 0, "SLURM_ARRAY_JOB_ID=4242_3")
    want = {**kept, ("a", 4): value("a", 4), ("a", 5): value("a", 5), ("c", 0): value("c", 0)}
    assert_values(contents(path), want)


def test_a_refused_save_removes_its_shards_and_names_the_dataset_written_before_any_job(tmp_path):
    path = tmp_path / "ds"
    tdgather.save(tdgather.gather({"a": [(i, value("a", i)) for i in range(3)]}), path)  # snapshot 0: no run tag
    listing = sorted(p.name for p in path.iterdir())
    with pytest.raises(DuplicateFrameError) as raised:
        save({"a": [(1, value("a", 1) - 2)]}, path, duplicates="exact")
    message = str(raised.value)
    assert message.startswith("filename 'a', frame_idx 1: the dataset written before any job appended (snapshot 0; ")
    assert "and this job (run " in message and "largest absolute difference 2" in message
    assert sorted(p.name for p in path.iterdir()) == listing  # save removed what it wrote
    assert [s.version for s in tdgather.snapshots(path)] == [0]
    assert sorted(contents(path)) == [("a", 0), ("a", 1), ("a", 2)]


# ---------------------------------------------------------------- "keep": the first stays, copies counted


def test_keep_keeps_the_first_copy_and_counts_exact_and_inexact_across_commits(tmp_path):
    path = tmp_path / "ds"
    save({"a": [(i, value("a", i)) for i in range(4)]}, path)
    held = {("a", i): value("a", i) for i in range(4)}
    assert tdgather.open(path).metadata["duplicates"] == {"exact": 0, "inexact": 0, "max_abs_diff": 0.0}

    # frame 2 bit-identical, frame 3 off by 0.5: both dropped, counted; 4 and 5 added
    sent = [(2, value("a", 2)), (3, value("a", 3) + 0.5), (4, value("a", 4)), (5, value("a", 5))]
    summary = collect(path, {"a": sent})
    assert summary.duplicates_dropped == 0  # a job's summary counts its own copies only
    ds = tdgather.open(path)
    assert ds.metadata["duplicates"] == {"exact": 1, "inexact": 1, "max_abs_diff": 0.5}
    assert ds.metadata["duplicates_dropped"] == 2
    s2 = tdgather.snapshots(path)[-1]
    assert (s2.added, s2.duplicates_dropped, s2.frames) == (2, 2, 6)
    held.update({("a", 4): value("a", 4), ("a", 5): value("a", 5)})
    assert_values(contents(path), held)  # a[3] is the first job's

    # a third job: frame 0 off by 0.25 (against the dataset), and frame 9 twice within the job (off by 4)
    with tdgather.Collector(path, append=True, progress=False, log_summary=False) as col:
        col.add(["a", "a"], [0, 9], [value("a", 0) + 0.25, value("a", 9)])
        col.add(["a"], [9], [value("a", 9) + 4])
    assert col.summary.duplicates == tdgather.DuplicateCounts(0, 1, 4.0)  # within the job
    ds = tdgather.open(path)
    # every commit's copies and every job's own: exact 1, inexact 1 + 1 + 1, the largest difference of all
    assert ds.metadata["duplicates"] == {"exact": 1, "inexact": 3, "max_abs_diff": 4.0}
    assert ds.metadata["duplicates_dropped"] == 4
    assert [(s.added, s.duplicates_dropped) for s in tdgather.snapshots(path)] == [(4, 0), (2, 2), (1, 1)]
    held[("a", 9)] = value("a", 9)
    assert_values(contents(path), held)


# ---------------------------------------------------------------- comparison policies


def test_close_counts_a_copy_within_its_tolerance_and_refuses_one_beyond(tmp_path):
    path = tmp_path / "ds"
    close = DuplicatePolicy("close", rtol=0.0, atol=1e-3)
    save({"a": [(i, value("a", i)) for i in range(3)]}, path)
    near = value("a", 1).clone()
    near[0] += 2**-12  # 0.000244: within atol
    save({"a": [(0, value("a", 0)), (1, near), (3, value("a", 3))]}, path, duplicates=close)
    ds = tdgather.open(path)
    assert ds.metadata["duplicates"] == {"exact": 1, "inexact": 1, "max_abs_diff": 2**-12}
    assert_values(contents(path), {("a", i): value("a", i) for i in range(4)})  # a[1] is the first job's
    before = state(path)

    far = value("a", 2).clone()
    far[2] -= 0.125
    with pytest.raises(DuplicateFrameError, match=r"filename 'a', frame_idx 2: the job of run [0-9a-f]{12} ") as e:
        save({"a": [(1, near), (2, far), (5, value("a", 5))]}, path, duplicates=close)
    assert "largest absolute difference 0.125" in str(e.value)
    assert "the duplicates policy is close (rtol=0, atol=0.001)" in str(e.value)
    assert state(path) == before
    save({"a": [(1, near), (2, far), (5, value("a", 5))]}, path)  # "keep": the first copies stay, counted
    assert tdgather.open(path).metadata["duplicates"] == {"exact": 1, "inexact": 3, "max_abs_diff": 0.125}
    assert_values(contents(path), {("a", i): value("a", i) for i in (0, 1, 2, 3, 5)})


def test_a_ragged_copy_with_another_number_of_rows_is_refused_by_exact_and_counted_by_keep(tmp_path):
    path = tmp_path / "ds"
    save({"t": [(i, boxes(i)) for i in range(3)]}, path)
    other = {"boxes": torch.zeros(5, 4), "score": boxes(1)["score"]}  # 5 boxes where the dataset has 2
    with pytest.raises(DuplicateFrameError, match=r"frame_idx 1: .*key 'boxes': 2 rows against 5"):
        save({"t": [(1, other)]}, path, duplicates="exact")
    save({"t": [(1, other), (3, boxes(3))]}, path)
    meta = tdgather.open(path).metadata
    assert meta["duplicates"] == {"exact": 0, "inexact": 1, "max_abs_diff": "inf"}
    assert_values(contents(path), {("t", i): boxes(i) for i in range(4)})


# ---------------------------------------------------------------- partial overlaps, copies within a job


def test_a_job_whose_frames_partly_overlap_adds_the_rest(tmp_path):
    path = tmp_path / "ds"
    save({"t": [(i, boxes(i)) for i in (0, 2, 4, 6)], "b": [(i, value("b", i)) for i in range(3)]}, path)
    job = {"t": [(i, boxes(i)) for i in range(8)], "b": [(2, value("b", 2)), (5, value("b", 5))], "c": [(0, boxes(0))]}
    save(job, path, duplicates="exact")  # every copy bit-identical: accepted, counted, cut out
    s2 = tdgather.snapshots(path)[-1]
    assert (s2.added, s2.duplicates_dropped, s2.frames, s2.filenames) == (6, 5, 13, 3)
    ds = tdgather.open(path)
    assert ds.metadata["duplicates"] == {"exact": 5, "inexact": 0, "max_abs_diff": 0.0}
    want = {("t", i): boxes(i) for i in range(8)} | {("b", i): value("b", i) for i in (0, 1, 2, 5)}
    assert_values(contents(path), {**want, ("c", 0): boxes(0)})
    assert ds["t"].frame_idx.tolist() == list(range(8))
    # the job's copies are cut from its segments: t's odd frames in runs of one, b's frame 5 alone
    mine = {seg["shard"] for seg in ds.index["files"]["c"]["segments"]}
    assert [s["frames"] for s in ds.index["files"]["t"]["segments"] if s["shard"] in mine] == [1, 1, 1, 1]
    # the frames and bytes listed are those of the same frames written at once (ragged rows included)
    at_once = {name: [(i, f) for (n, i), f in sorted(want.items()) if n == name] for name in ("t", "b")}
    whole = tdgather.open(tdgather.save(tdgather.gather({**at_once, "c": [(0, boxes(0))]}), tmp_path / "whole"))
    for key in ("total_frames", "total_bytes", "num_filenames"):
        assert ds.metadata[key] == whole.metadata[key], key


def test_copies_within_one_job_are_resolved_as_without_append(tmp_path):
    path = tmp_path / "ds"
    save({"a": [(0, value("a", 0))]}, path)
    before = state(path)
    # frame 7 twice in this job, the dataset has no frame 7: the job's policy refuses it while it writes
    with pytest.raises(DuplicateFrameError) as raised:
        with tdgather.Collector(path, append=True, duplicates="exact", progress=False, log_summary=False) as col:
            col.add(["n"], [7], [value("n", 7)])
            col.add(["n"], [7], [value("n", 7) + 1])
    message = str(raised.value)
    assert message.startswith("filename 'n', frame_idx 7: rank 0, in two copies, sent values that differ")
    assert "DistributedSampler padding" in message and "the job of run" not in message
    assert state(path) == before

    with tdgather.Collector(path, append=True, duplicates="exact", progress=False, log_summary=False) as col:
        col.add(["n", "n"], [7, 8], [value("n", 7), value("n", 8)])
        col.add(["n"], [7], [value("n", 7)])  # bit-identical: accepted, counted within the job
    assert col.summary.duplicates == tdgather.DuplicateCounts(1, 0, 0.0)
    s2 = tdgather.snapshots(path)[-1]
    assert (s2.added, s2.duplicates_dropped) == (2, 0)  # the commit dropped nothing: the dataset had no frame 7
    meta = tdgather.open(path).metadata
    assert meta["duplicates"] == {"exact": 1, "inexact": 0, "max_abs_diff": 0.0} and meta["duplicates_dropped"] == 1
    assert_values(contents(path), {("a", 0): value("a", 0), ("n", 7): value("n", 7), ("n", 8): value("n", 8)})
