"""A job that appends and is run again continues its own run (``append=True, resume=True``; `tdgather.storage.jobmark`).

A job SIGKILLed after it wrote shards, run again with the same key (``TDGATHER_JOB``, or the
scheduler's id), takes those shards as saved, computes only the rest, and commits both; run again
after its commit, it adds nothing; two copies of one job at once claim different attempts and
each frame is in the dataset once; a job without a key, or a mark edited by hand, is refused by name.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tdgather
from tdgather.errors import DatasetError, OutputError
from tdgather.format.names import JOB_MARK_NAME
from tdgather.storage.writer import DatasetWriter
from tdgather.tools.launch import run_local_world

ITEMS = [("a.mp4", i) for i in range(12)] + [("b.mp4", i) for i in range(6)]


def value(name: str, idx: int) -> torch.Tensor:
    return torch.arange(3.0) + idx * 10 + (100 if name == "b.mp4" else 0)


def job(path: str, key: str, log: str, kill_at: int | None = None, storage_options: dict | None = None) -> None:
    """Add the items this job's earlier attempts did not save; SIGKILL itself once ``kill_at`` shards are written.

    Appends ``[saved, computed]`` to ``log`` (a JSON line an attempt) before it computes anything.
    """
    os.environ["TDGATHER_JOB"] = key
    with tdgather.Collector(
        path, append=True, resume=True, progress=False, commit_every=0.01, storage_options=storage_options
    ) as col:
        todo = col.saved.todo(ITEMS)
        with open(log, "a") as f:
            f.write(json.dumps([len(ITEMS) - len(todo), len(todo)]) + "\n")
        for name, idx in todo:
            col.add([name], [idx], value(name, idx)[None])
            time.sleep(0.02)  # a model's step: shards are written (commit_every) as frames come
            if kill_at is not None and col.status().shards >= kill_at:
                time.sleep(0.5)  # its last shard made durable, in the background
                os.kill(os.getpid(), signal.SIGKILL)


def attempt(path: str, key: str, log: str, kill_at: int | None = None, storage_options: dict | None = None) -> int:
    """One attempt of the job in its own process; its exit code."""
    p = multiprocessing.get_context("spawn").Process(target=job, args=(path, key, log, kill_at, storage_options))
    p.start()
    p.join(240)
    if p.exitcode is None:
        p.kill()
        p.join(30)
    return p.exitcode


def logged(log: str) -> list[list[int]]:
    return [json.loads(line) for line in Path(log).read_text().splitlines()]


def frames(ds: tdgather.Dataset) -> dict[str, list[int]]:
    out = {}
    for name in ds:
        clip = ds[name]
        out[name] = clip.frame_idx.tolist()
        for k, i in enumerate(out[name]):
            assert torch.equal(clip.frames[k], value(name, i)), (name, i)
    return out


WHOLE = {"a.mp4": list(range(12)), "b.mp4": list(range(6))}


def test_a_job_killed_after_writing_shards_continues_its_run_when_run_again(tmp_path):
    path, log = str(tmp_path / "ds"), str(tmp_path / "log")
    assert attempt(path, "task-7", log, kill_at=2) == -signal.SIGKILL
    assert not tdgather.snapshots(path)  # nothing committed: no reader sees the shards
    shards = sorted(n for n in os.listdir(path) if n.startswith("shard-"))
    assert len(shards) >= 2 and all(n.endswith("-1.safetensors") for n in shards)
    assert attempt(path, "task-7", log) == 0
    (saved0, computed0), (saved, computed) = logged(log)
    assert (saved0, computed0) == (0, len(ITEMS)) and saved > 0 and saved + computed == len(ITEMS)
    ds = tdgather.open(path)
    assert frames(ds) == WHOLE
    (snap,) = tdgather.snapshots(path)
    assert (snap.job, snap.added, snap.duplicates_dropped) == ("task-7", len(ITEMS), 0)
    listed = sorted(ds.index["shards"])
    assert set(shards) <= set(listed) and any(n.endswith("-2.safetensors") for n in listed)  # both attempts
    assert len({n.split(".")[1].split("-")[0] for n in listed}) == 1  # one run
    assert sorted(JOB_MARK_NAME.fullmatch(n)[2] for n in os.listdir(path) if JOB_MARK_NAME.fullmatch(n)) == [
        "0001",
        "0002",
    ]
    assert attempt(path, "task-7", log) == 0  # run again after its commit: everything is saved, nothing added
    assert logged(log)[-1] == [len(ITEMS), 0]
    assert [s.added for s in tdgather.snapshots(path)] == [len(ITEMS), 0]
    assert frames(tdgather.open(path)) == WHOLE
    assert attempt(path, "task-8", log) == 0  # another job (another key) is a new run: its copies are dropped
    assert logged(log)[-1] == [0, len(ITEMS)]
    assert tdgather.snapshots(path)[-1].duplicates_dropped == len(ITEMS)


def test_two_copies_of_one_job_at_once_claim_different_attempts_and_each_frame_is_there_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TDGATHER_JOB", "SLURM_JOB_ID=99")
    path = tmp_path / "ds"
    first = DatasetWriter(path, append=True, resume=True)
    first.write(tdgather.gather({"a.mp4": [(i, value("a.mp4", i)) for i in range(6)]}))
    first.report()  # durable: the second copy finds it
    second = DatasetWriter(path, append=True, resume=True)  # the same job, requeued while the first still runs
    assert (first.run, first.attempt, second.run, second.attempt) == (first.run, 1, first.run, 2)
    assert second.saved.todo([("a.mp4", i) for i in range(8)]) == [("a.mp4", 6), ("a.mp4", 7)]
    second.write(
        tdgather.gather({"a.mp4": [(i, value("a.mp4", i)) for i in range(6, 8)], "b.mp4": [(0, value("b.mp4", 0))]})
    )
    first.write(tdgather.gather({"a.mp4": [(i, value("a.mp4", i)) for i in range(6, 10)]}))  # overlaps the second's
    second.commit({})
    first.commit({})
    assert frames(tdgather.open(path)) == {"a.mp4": list(range(10)), "b.mp4": [0]}
    snaps = tdgather.snapshots(path)
    assert [s.added for s in snaps] == [9, 2] and snaps[1].duplicates_dropped == 2  # the first's 6 and 7


def test_a_job_without_a_key_cannot_resume_and_says_what_to_set(tmp_path, monkeypatch):
    for var in ("TDGATHER_JOB", "SLURM_ARRAY_JOB_ID", "SLURM_JOB_ID", "JOB_COMPLETION_INDEX", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(OutputError, match="set TDGATHER_JOB=<a name for this job's share>"):
        DatasetWriter(tmp_path / "ds", append=True, resume=True)
    with pytest.raises(OutputError, match="overwrite=True does not go with it"):
        DatasetWriter(tmp_path / "ds", append=True, overwrite=True)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda m: m.update(run="../../etc"), "run"),
        (lambda m: m.update(attempt=3), "job"),  # not the attempt its name says
        (lambda m: m.update(job="task-8"), "job"),  # not the job its name says
        (lambda m: m.update(extra=1), "mark"),
        (lambda m: m.update(opened="yesterday"), "opened"),
    ],
)
def test_a_job_mark_edited_by_hand_is_refused_naming_the_field(tmp_path, monkeypatch, edit, field):
    monkeypatch.setenv("TDGATHER_JOB", "task-7")
    path = tmp_path / "ds"
    w = DatasetWriter(path, append=True, resume=True)
    w.write(tdgather.gather({"a.mp4": [(0, value("a.mp4", 0))]}))
    w.commit({})
    (mark,) = [path / n for n in os.listdir(path) if JOB_MARK_NAME.fullmatch(n)]
    obj = json.loads(mark.read_text())
    edit(obj)
    mark.write_text(json.dumps(obj))
    with pytest.raises(DatasetError, match=rf"{mark.name}: {field}"):
        DatasetWriter(path, append=True, resume=True)
    assert frames(tdgather.open(path)) == {"a.mp4": [0]}


def _world_job(path: str, log: str, kill: bool) -> int:
    """A 2-rank world appending with resume; rank 0 SIGKILLs itself once it wrote 2 shards (``kill``).

    The key is set here: a world's ranks start from a server that may be older than the test's environment.
    """
    os.environ["TDGATHER_JOB"] = "SLURM_ARRAY_JOB_ID=5_3"
    with tdgather.Collector(path, append=True, resume=True, progress=False, commit_every=0.01) as col:
        todo = col.saved.todo(ITEMS)
        if dist.get_rank() == 0:
            with open(log, "a") as f:
                f.write(json.dumps([len(ITEMS) - len(todo), len(todo)]) + "\n")
        for name, idx in todo[dist.get_rank() :: 2]:
            col.add([name], [idx], value(name, idx)[None])
            time.sleep(0.05)
            if kill and dist.get_rank() == 0 and col.status().shards >= 2:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
    return dist.get_rank()


def test_a_torchrun_world_killed_mid_job_continues_its_run_when_run_again(tmp_path):
    path, log = str(tmp_path / "ds"), str(tmp_path / "log")
    with pytest.raises(Exception):  # noqa: B017 - rank 0 SIGKILLed: the world fails, however it reports it
        run_local_world(_world_job, 2, path, log, True, timeout=120)
    assert not tdgather.snapshots(path)
    assert run_local_world(_world_job, 2, path, log, False, timeout=120) == [0, 1]
    (_, _), (saved, computed) = logged(log)
    assert saved > 0 and saved + computed == len(ITEMS)
    assert frames(tdgather.open(path)) == WHOLE
    assert tdgather.snapshots(path)[-1].added == len(ITEMS)


def test_a_job_killed_on_s3_continues_its_run_when_run_again(s3, url, tmp_path):
    log = str(tmp_path / "log")
    assert attempt(url, "task-1", log, kill_at=2, storage_options=s3) == -signal.SIGKILL
    assert attempt(url, "task-1", log, storage_options=s3) == 0
    (_, _), (saved, computed) = logged(log)
    assert saved > 0 and saved + computed == len(ITEMS)
    assert frames(tdgather.open(url, storage_options=s3)) == WHOLE
    assert tdgather.snapshots(url, storage_options=s3)[-1].added == len(ITEMS)


def test_torchruns_own_run_id_is_not_a_key_it_changes_at_every_launch(tmp_path, monkeypatch):
    for var in ("TDGATHER_JOB", "SLURM_ARRAY_JOB_ID", "SLURM_JOB_ID", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "5b0c5c3e-run")
    with pytest.raises(OutputError, match="set TDGATHER_JOB"):
        DatasetWriter(tmp_path / "ds", append=True, resume=True)
    w = DatasetWriter(tmp_path / "ds", append=True)  # without resume it appends; the snapshot names no key
    w.write(tdgather.gather({"a.mp4": [(0, value("a.mp4", 0))]}))
    w.commit({})
    assert tdgather.snapshots(tmp_path / "ds")[-1].job is None
