"""Many independent jobs append to one dataset, each frame exactly once (tests/append_cases.py).

Jobs run at once as real processes: plain single processes (no process group) and 2-rank gloo
worlds, their shares overlapping. A reader polls throughout and must only ever see whole
snapshots; jobs SIGKILLed at random moments and then rerun must leave the same dataset.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time

import pytest

import tdgather
from tdgather.errors import OutputError
from tdgather.tools.launch import run_local_world

from . import append_cases as ac

pytestmark = pytest.mark.world


def _poll(path: str, stop: threading.Event, seen: list[int], errors: list[BaseException]) -> None:
    """Open the newest snapshot again and again, reading every frame: totals never shrink, values never differ."""
    while not stop.is_set():
        try:
            ds = tdgather.open(path)
        except OutputError:  # no snapshot yet
            time.sleep(0.05)
            continue
        try:
            frames = ac.check(ds)
            assert sum(map(len, frames.values())) == ds.metadata["total_frames"]
            assert not seen or ds.metadata["total_frames"] >= seen[-1], (seen[-1], ds.metadata["total_frames"])
            seen.append(ds.metadata["total_frames"])
        except BaseException as e:  # reported by the test
            errors.append(e)
            return


def _plain(path: str, job: int, pause: float = 0.0) -> multiprocessing.Process:
    p = multiprocessing.get_context("spawn").Process(target=ac.plain_job, args=(path, job, pause))
    p.start()
    return p


def _final(path: str, jobs: list[int]) -> tdgather.Dataset:
    """The newest snapshot holds every frame the jobs sent exactly once, bit for bit."""
    ds = tdgather.open(path)
    got = ac.check(ds)
    assert {name: set(idx) for name, idx in got.items()} == ac.expected(jobs)
    assert all(len(idx) == len(set(idx)) for idx in got.values())
    total = sum(map(len, ac.expected(jobs).values()))
    assert ds.metadata["total_frames"] == total
    return ds


def test_plain_processes_and_worlds_appending_at_once_keep_every_frame_once(tmp_path):
    path = str(tmp_path / "ds")
    stop, seen, errors = threading.Event(), [], []
    poller = threading.Thread(target=_poll, args=(path, stop, seen, errors))
    poller.start()
    worlds = [
        threading.Thread(target=run_local_world, args=(ac.world_job, 2, path, job), kwargs={"timeout": 240})
        for job in (0, 1)
    ]
    for t in worlds:
        t.start()
    plains = [_plain(path, job) for job in range(2, 6)]
    for p in plains:
        p.join(240)
    for t in worlds:
        t.join(240)
    stop.set()
    poller.join(60)
    assert not errors, errors[0]
    assert all(p.exitcode == 0 for p in plains), [p.exitcode for p in plains]
    jobs = list(range(6))
    ds = _final(path, jobs)
    assert ds.metadata["duplicates_dropped"] == ac.sent(jobs) - ds.metadata["total_frames"]
    snaps = tdgather.snapshots(path)
    assert [s.version for s in snaps] == list(range(1, 7))  # one a job, none lost
    assert sum(s.added for s in snaps) == ds.metadata["total_frames"] and len({s.run for s in snaps}) == 6
    previous: dict[str, set[int]] = {}
    for s in snaps:  # each snapshot as it was committed: whole, and holding every earlier one's frames
        frames = ac.check(tdgather.open(path, version=s.version))
        assert sum(map(len, frames.values())) == s.frames
        assert all(previous[n] <= set(frames.get(n, ())) for n in previous)
        previous = {n: set(idx) for n, idx in frames.items()}


def test_jobs_killed_at_random_moments_then_rerun_leave_each_frame_once(tmp_path):
    path = str(tmp_path / "ds")
    rng = random.Random(7)
    jobs = list(range(6))
    procs = {job: _plain(path, job, pause=0.05) for job in jobs}  # about 1 s of adding a job, after the start
    killed = rng.sample(jobs, 3)
    time.sleep(rng.uniform(2.0, 4.0))  # some while importing, some adding, some committing or done
    for job in killed:
        procs[job].kill()
    for job, p in procs.items():
        p.join(240)
        assert job in killed or p.exitcode == 0, (job, p.exitcode)
    before = {s.run for s in tdgather.snapshots(path)} if tdgather.snapshots(path) else set()
    reruns = [_plain(path, job) for job in killed]  # as a requeue would: the same shares again
    for p in reruns:
        p.join(240)
        assert p.exitcode == 0
    _final(path, jobs)
    snaps = tdgather.snapshots(path)
    assert before <= {s.run for s in snaps} and len(snaps) >= len(jobs)
    assert [s.version for s in snaps] == list(range(1, len(snaps) + 1))
