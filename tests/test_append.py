"""Many independent jobs append to one dataset, each frame exactly once (tests/append_cases.py).

Jobs run at once as real processes: plain single processes (no process group) and 2-rank gloo
worlds, their shares overlapping. A reader polls throughout and must only ever see whole
snapshots; jobs SIGKILLed at random moments and then rerun must leave the same dataset.
"""

from __future__ import annotations

import multiprocessing
import random
import signal
import threading
import time

import pytest

import tdgather
from tdgather.errors import OutputError
from tdgather.tools.launch import run_local_world

from . import append_cases as ac

pytestmark = pytest.mark.world


def _poll(
    path: str, stop: threading.Event, seen: list[int], errors: list[BaseException], storage_options: dict | None = None
) -> None:
    """Open the newest snapshot again and again, reading every frame: totals never shrink, values never differ."""
    while not stop.is_set():
        try:
            ds = tdgather.open(path, storage_options=storage_options)
        except OutputError as e:  # no snapshot yet; once one was seen, there is always one
            if seen:
                errors.append(e)
                return
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


def _plain(path: str, job: int, pause: float = 0.0, storage_options: dict | None = None) -> multiprocessing.Process:
    p = multiprocessing.get_context("spawn").Process(
        target=ac.plain_job, args=(path, job, pause), kwargs={"storage_options": storage_options}
    )
    p.start()
    return p


def _final(path: str, jobs: list[int], storage_options: dict | None = None) -> tdgather.Dataset:
    """The newest snapshot holds every frame the jobs sent exactly once, bit for bit."""
    ds = tdgather.open(path, storage_options=storage_options)
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
    time.sleep(rng.uniform(2.0, 4.0))
    procs[killed[0]].kill()  # on 2 cores, jobs still import this early: killed before its commit, as a rule
    deadline = time.monotonic() + 180
    while not tdgather.snapshots(path) and time.monotonic() < deadline and any(p.is_alive() for p in procs.values()):
        time.sleep(0.02)
    first = time.monotonic()  # the others around the first commits: adding, committing, or just committed
    for at, job in sorted((rng.uniform(0.0, 1.0), job) for job in killed[1:]):
        time.sleep(max(0.0, first + at - time.monotonic()))
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


def test_what_no_job_has_committed_yet_is_the_next_tasks_share(tmp_path):
    """``saved_at(path).todo(items)`` over the whole run's items: the frames of jobs killed before their commit."""
    path = str(tmp_path / "ds")
    for job in (0, 1):
        ac.plain_job(path, job)
    killed = _plain(path, 2, pause=0.5)  # killed while it adds: it commits nothing
    time.sleep(3.0)
    killed.kill()
    killed.join(60)
    items = [(name, idx) for job in range(3) for name, idxs in ac.share(job).items() for idx in idxs]
    todo = tdgather.saved_at(path).todo(items)
    held = ac.expected([0, 1])
    assert todo == [(n, i) for n, i in items if i not in held.get(n, set())] and todo  # job 2's own, at least
    with tdgather.Collector(path, append=True, progress=False) as col:  # the next task takes them
        for name, idx in todo:
            col.add([name], [idx], [ac.value(name, idx)])
    assert col.summary.snapshot == 3 and "committed as snapshot 3" in str(col.summary)
    assert tdgather.saved_at(path).todo(items) == []
    _final(path, [0, 1, 2])
    assert tdgather.snapshots(path)[-1].duplicates_dropped == 0  # it sent only what was missing


def test_jobs_killed_at_random_moments_on_s3_then_rerun_leave_each_frame_once(url, s3):
    """The local kill test's S3 twin: commits are ``If-None-Match`` PUTs; a reader polls throughout.

    Jobs spend most of their first seconds importing, so a kill 2 to 4 s after the start comes, as
    a rule, before any commit; the other kills are timed from the first commit seen, when jobs add, commit
    or have just committed (a killed job may also have finished: its rerun then adds nothing).
    """
    rng = random.Random(11)
    jobs = list(range(5))
    stop, seen, errors = threading.Event(), [], []
    poller = threading.Thread(target=_poll, args=(url, stop, seen, errors, s3))
    poller.start()
    procs: dict[int, multiprocessing.Process] = {}
    reruns: list[multiprocessing.Process] = []
    try:
        procs.update((job, _plain(url, job, pause=0.05, storage_options=s3)) for job in jobs)
        killed = rng.sample(jobs, rng.choice((2, 3)))
        time.sleep(rng.uniform(2.0, 4.0))
        procs[killed[0]].kill()  # while importing or adding, as a rule
        deadline = time.monotonic() + 180
        while not tdgather.snapshots(url, storage_options=s3) and time.monotonic() < deadline:
            if not any(p.is_alive() for p in procs.values()):
                break
            time.sleep(0.05)
        first = time.monotonic()
        for at, job in sorted((rng.uniform(0.0, 1.5), job) for job in killed[1:]):  # around the others' commits
            time.sleep(max(0.0, first + at - time.monotonic()))
            procs[job].kill()
        for job, p in procs.items():
            p.join(240)
            assert p.exitcode == 0 or (job in killed and p.exitcode == -signal.SIGKILL), (job, p.exitcode)
        before = tdgather.snapshots(url, storage_options=s3)
        assert len(before) >= sum(p.exitcode == 0 for p in procs.values())  # a job that exited committed first
        if before:  # whole: every frame once, each job that was not killed all there
            got = ac.check(tdgather.open(url, storage_options=s3))
            survivors = ac.expected([job for job in jobs if job not in killed])
            assert all(len(idx) == len(set(idx)) for idx in got.values())
            assert all(survivors[n] <= set(got.get(n, ())) for n in survivors)
            assert all(set(idx) <= ac.expected(jobs)[n] for n, idx in got.items())
        reruns += [_plain(url, job, storage_options=s3) for job in killed]  # as a requeue would: the same shares
        for p in reruns:
            p.join(240)
            assert p.exitcode == 0, p.exitcode
    finally:
        for p in [*procs.values(), *reruns]:  # none left behind when an assertion failed
            p.kill()
            p.join(60)
        stop.set()
        poller.join(120)
    assert not errors, errors[0]
    assert seen, "the reader never saw a snapshot"
    ds = _final(url, jobs, storage_options=s3)
    snaps = tdgather.snapshots(url, storage_options=s3)
    assert [s.version for s in snaps] == list(range(1, len(snaps) + 1))
    assert len(snaps) == len(before) + len(killed)  # one commit a rerun, none lost
    assert {s.run for s in before} <= {s.run for s in snaps} and len({s.run for s in snaps}) == len(snaps)
    assert sum(s.added for s in snaps) == ds.metadata["total_frames"] == snaps[-1].frames
    previous: dict[str, set[int]] = {}
    for s in snaps:  # each snapshot as it was committed: whole, and holding every earlier one's frames
        frames = ac.check(tdgather.open(url, storage_options=s3, version=s.version))
        assert sum(map(len, frames.values())) == s.frames
        assert all(previous[n] <= set(frames.get(n, ())) for n in previous)
        previous = {n: set(idx) for n, idx in frames.items()}
