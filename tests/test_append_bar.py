"""The bar for many jobs appending to one dataset (docs/many-jobs.md), in a directory and on S3 (a moto server).

16 jobs append at once (tests/append_bar_cases.py): 4 two-rank gloo worlds and 12 plain processes,
each its own share of the frames, neighbours' shares overlapping. Nine of them are SIGKILLed by
the test, each where it announces it is (a marker file), so every kind of kill happens in every run:

- before its commit: while adding (a world's rank 0, a plain job);
- during its commit: before its conditional write (nothing committed); with its snapshot half written
  (locally: a torn temporary file); a moment after it began the write, racing it (committed or not,
  killed or ended: the snapshots say); once the write landed, before it returned (committed);
- after its commit, before the process exits (committed).

Each killed job is rerun as soon as it is dead (the same share, as a requeue would); the rerun of a
job that had committed adds nothing. A reader polls throughout: every snapshot it opens is whole,
every frame bit for bit, totals never shrink. At the end: every frame once, bit for bit, the counts
exact (each attempt's run id says which attempts committed), snapshots 1..n, and every snapshot
read back as it was committed (as the reader saw it, where it did). Then a compaction and an expiry
(`compact_and_expire`): every frame again bit for bit, and nothing left but the compacted snapshot.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import tdgather
from tdgather.errors import OutputError
from tdgather.format.names import JOB_MARK_NAME, snapshot_name
from tdgather.storage.location import store_at
from tdgather.tools.launch import WorldError, run_local_world

from . import append_bar_cases as bar
from .append_cases import check

pytestmark = pytest.mark.world

TIMEOUT = 150.0  # seconds for every job of a test, reruns included (and each world's own timeout)
# plain jobs start from the forkserver that `run_local_world` starts for the worlds (torch imported once): each is a
# process of its own, with no process group; on 2 cores, 18 processes importing torch would take most of the time
CTX = multiprocessing.get_context("forkserver")
PRELOAD = ["torch", "torch.distributed", "tensordict", "tdgather"]  # as `run_local_world` has it
POLL = {"local": 0.1, "s3": 0.5}  # seconds between the reader's polls, each reading every frame (S3: through moto)


@dataclass
class Attempt:
    """One run of a job: a world (a thread running `run_local_world`) or a plain process."""

    job: int
    world: bool
    mode: str | None  # where the test kills it (`append_bar_cases`); None: it runs through
    attempt: int = 1
    proc: Any = None  # the plain job's process, or the thread running the world
    error: BaseException | None = None  # the world's `WorldError`
    kill_at: float | None = None  # when the test kills it, once it announced its mode
    killed: bool = False

    @property
    def label(self) -> str:
        return f"j{self.job}-a{self.attempt}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def died(self) -> bool:
        """Killed (a world: its rank 0), not run through (a racing kill may come once the job has ended)."""
        return self.error is not None if self.world else self.proc.exitcode != 0


@dataclass
class Bar:
    """What a run of the bar leaves, to check the dataset again after a later step (a compaction, an expiry)."""

    path: str
    storage_options: dict | None
    expected: frozenset  # every (filename, frame_idx) of every job, once; `append_cases.value` gives each one's value
    attempts: list[Attempt]
    seen: dict[int, frozenset]  # the snapshots the reader saw while jobs ran: version -> its frames
    contents: dict[int, frozenset] = field(default_factory=dict)  # every snapshot at the end: version -> its frames
    snapshots: list[tdgather.Snapshot] = field(default_factory=list)
    committed: list[Attempt] = field(default_factory=list)  # the attempt that committed each snapshot


class Reader(threading.Thread):
    """Opens the newest snapshot again and again, reading every frame: whole, bit for bit, totals never shrinking."""

    def __init__(self, path: str, storage_options: dict | None) -> None:
        super().__init__(daemon=True)
        self.path, self.storage_options = path, storage_options
        self.poll = POLL["local" if storage_options is None else "s3"]
        self.stop = threading.Event()
        self.seen: dict[int, frozenset] = {}
        self.versions: list[int] = []  # the version of each poll
        self.errors: list[BaseException] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                ds = tdgather.open(self.path, storage_options=self.storage_options)
            except OutputError as e:  # no snapshot yet; once one was seen, there is always one
                if self.versions:
                    self.errors.append(e)
                    return
                self.stop.wait(0.05)
                continue
            except BaseException as e:  # reported by the test
                self.errors.append(e)
                return
            try:
                version = ds.index["snapshot"]["version"]
                got = frames(ds)
                assert len(got) == ds.metadata["total_frames"], (version, len(got), ds.metadata["total_frames"])
                assert not self.versions or version >= self.versions[-1], (self.versions[-1], version)
                assert self.seen.setdefault(version, got) == got, f"snapshot {version} read back otherwise"
                lost = {v: sorted(self.seen[v] - got) for v in self.seen if v <= version and not self.seen[v] <= got}
                assert not lost, f"snapshot {version} lacks frames of earlier ones: {lost}"
                self.versions.append(version)
            except BaseException as e:
                self.errors.append(e)
                return
            self.stop.wait(self.poll)


def frames(ds: tdgather.Dataset) -> frozenset:
    """The frames ``(filename, frame_idx)`` of ``ds``, each read and checked bit for bit, each listed once."""
    got = check(ds)
    assert all(len(idx) == len(set(idx)) for idx in got.values()), got
    assert len(got) == ds.metadata["num_filenames"]
    return frozenset((name, i) for name, idx in got.items() for i in idx)


def plan(rng: random.Random, local: bool) -> list[Attempt]:
    """16 jobs, 4 of them worlds; 9 killed: 3 worlds (before, during, after their commit) and 6 plain jobs."""
    worlds = sorted(rng.sample(range(bar.JOBS), 4))
    during = ["commit", "racing", "landed", "torn" if local else "commit"]
    world_modes = ["adding", rng.choice(during), "committed", None]
    plain_modes = ["adding", "commit", "racing", "landed", "committed", "torn" if local else "racing"] + [None] * 6
    rng.shuffle(world_modes)
    rng.shuffle(plain_modes)
    modes = iter(plain_modes)
    return [
        Attempt(job, True, world_modes[worlds.index(job)]) if job in worlds else Attempt(job, False, next(modes))
        for job in range(bar.JOBS)
    ]


def start(a: Attempt, path: str, markers: Path, storage_options: dict | None) -> None:
    args = (path, a.job, a.label, a.mode, str(markers), storage_options)
    if a.world:

        def world() -> None:
            try:
                run_local_world(bar.world_job, 2, *args, timeout=TIMEOUT)
            except WorldError as e:  # its rank 0 killed: checked by the test
                a.error = e

        a.proc = threading.Thread(target=world, daemon=True)
    else:
        a.proc = CTX.Process(target=bar.plain_job, args=args)
    a.proc.start()


def kill(a: Attempt, markers: Path) -> None:
    """SIGKILL the job where it is (a world: its rank 0, whose pid its marker holds)."""
    if a.world:
        if a.alive():  # racing: the world may have ended
            with contextlib.suppress(ProcessLookupError):
                os.kill(int((markers / f"{a.label}.{a.mode}").read_text()), signal.SIGKILL)
    else:
        a.proc.kill()
    a.killed = True


def stop_all(attempts: list[Attempt], markers: Path) -> None:
    """Kill what is left (a test that failed), then wait for every job."""
    for a in attempts:
        if a.alive() and not a.world:
            a.proc.kill()
        if a.alive() and a.world:  # each rank announced its pid
            for pid in markers.glob(f"{a.label}.pid*"):
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid.read_text()), signal.SIGKILL)
    for a in attempts:
        if a.proc is not None:
            a.proc.join(30)


def run_bar(path: str, markers: Path, seed: int, storage_options: dict | None = None) -> Bar:
    """16 jobs at once, 9 killed and rerun, a reader throughout; every check of the bar; what is left."""
    local = storage_options is None
    CTX.set_forkserver_preload(PRELOAD)
    rng = random.Random(seed)
    attempts = plan(rng, local)
    reader = Reader(path, storage_options)
    reader.start()
    everyone = list(attempts)
    try:
        for a in attempts:
            start(a, path, markers, storage_options)
        live, deadline = list(attempts), time.monotonic() + TIMEOUT
        while live:
            for a in list(live):
                if a.mode and a.kill_at is None and (markers / f"{a.label}.{a.mode}").exists():
                    a.kill_at = time.monotonic() + (rng.uniform(0.0, 0.05) if a.mode == "racing" else 0.0)
                if a.kill_at is not None and not a.killed and time.monotonic() >= a.kill_at:
                    kill(a, markers)
                if a.alive():
                    continue
                live.remove(a)
                if a.mode:  # as a requeue would: the same share again, as soon as the job has ended
                    ended = a.error if a.world else a.proc.exitcode
                    assert a.killed or a.mode == "racing", f"{a.label} ({a.mode}) ended before it was killed: {ended}"
                    rerun = Attempt(a.job, a.world, None, a.attempt + 1)
                    everyone.append(rerun)
                    start(rerun, path, markers, storage_options)
                    live.append(rerun)
            assert time.monotonic() < deadline, f"still running after {TIMEOUT:g} s: {[a.label for a in live]}"
            time.sleep(0.01)
    finally:  # nothing left behind when something failed
        stop_all(everyone, markers)
        reader.stop.set()
        reader.join(60)
    assert not reader.is_alive() and not any(a.alive() for a in everyone)
    assert not reader.errors, reader.errors[0]
    assert reader.seen, "the reader never saw a snapshot"

    for a in everyone:  # each ran through, or died of the test's kill (racing: the kill may have come too late)
        if a.world:
            assert (a.error is not None) == a.killed or a.mode == "racing", (a.label, a.mode, a.error)
            assert a.error is None or 0 in a.error.failures, (a.label, a.error)
        else:
            want = (0, -signal.SIGKILL) if a.mode == "racing" else (-signal.SIGKILL,) if a.killed else (0,)
            assert a.proc.exitcode in want, (a.label, a.mode, a.proc.exitcode)
    if local:  # the torn job left half its snapshot under the temporary name, which nothing lists
        assert [p for p in Path(path).glob(".tdgather.snapshot-*.json.tmp-*") if p.stat().st_size]

    expected = frozenset((name, i) for name, idx in bar.expected(range(bar.JOBS)).items() for i in idx)
    result = Bar(path, storage_options, expected, everyone, dict(reader.seen))
    check_commits(result, markers)
    check_newest(result)
    result.contents = check_every_snapshot(result)
    return result


def check_commits(result: Bar, markers: Path) -> None:
    """One snapshot for each attempt that committed, as its kill says, each bringing the attempt's whole share."""
    runs = {a.label: m.read_text() if (m := markers / f"{a.label}.run").exists() else None for a in result.attempts}
    assert all(runs[a.label] or a.mode == "adding" for a in result.attempts), runs  # its sink made: its run id
    by_run = {runs[a.label]: a for a in result.attempts if runs[a.label]}
    assert len(by_run) == sum(map(bool, runs.values()))
    snaps = tdgather.snapshots(result.path, storage_options=result.storage_options)
    assert [s.version for s in snaps] == list(range(1, len(snaps) + 1))  # no gap, none lost
    assert all(s.run in by_run for s in snaps), [s.run for s in snaps]  # every snapshot an attempt's...
    committed = [by_run[s.run] for s in snaps]
    labels = {a.label for a in committed}
    assert len(labels) == len(snaps)  # ...each attempt's once
    for a in result.attempts:  # racing, killed (None): either, as the snapshots say
        want = bar.COMMITS[a.mode] if a.died() else True
        assert want is None or (a.label in labels) == want, (a.label, a.mode, a.died(), want)
    first = {a.job for a in committed if a.attempt == 1}
    for s, a in zip(snaps, committed, strict=True):
        assert s.added + s.duplicates_dropped == bar.sent(a.job), (s, a.label)
        assert (s.added == 0) == (a.attempt > 1 and a.job in first), (s, a.label)  # a rerun of a committed job's
    total = len(result.expected)
    assert snaps[-1].frames == total == sum(s.added for s in snaps)
    copies = sum(bar.sent(a.job) for a in committed)  # what the committed attempts sent, copies included
    assert sum(s.duplicates_dropped for s in snaps) == copies - total
    result.snapshots, result.committed = snaps, committed


def check_newest(result: Bar) -> tdgather.Dataset:
    """The newest snapshot: every frame once, bit for bit; the totals exact (each copy the commits dropped counted)."""
    ds = tdgather.open(result.path, storage_options=result.storage_options)
    got = frames(ds)
    assert got == result.expected, (sorted(result.expected - got), sorted(got - result.expected))
    assert ds.metadata["total_frames"] == len(result.expected)
    assert ds.metadata["duplicates_dropped"] == sum(s.duplicates_dropped for s in result.snapshots)
    return ds


def check_every_snapshot(result: Bar) -> dict[int, frozenset]:
    """Each snapshot as it was committed: whole, bit for bit, its parent's frames and its job's; what each holds."""
    contents: dict[int, frozenset] = {}
    previous: frozenset = frozenset()
    for s, a in zip(result.snapshots, result.committed, strict=True):
        old = tdgather.open(result.path, version=s.version, storage_options=result.storage_options)
        held = frames(old)
        assert old.index["snapshot"]["version"] == s.version
        assert len(held) == s.frames == old.metadata["total_frames"] and len(old) == s.filenames, s
        assert previous <= held and len(held - previous) == s.added, s
        assert held - previous <= frozenset(bar.frames_of(a.job)) <= held, s  # what it added: its job's
        assert result.seen.get(s.version, held) == held, f"snapshot {s.version} reads otherwise than the reader saw"
        contents[s.version] = previous = held
    return contents


def compact_and_expire(result: Bar) -> None:
    """Then a compaction and an expiry of everything else: every frame bit for bit, nothing but the newest left.

    The compacted snapshot reads as the one it rewrote (frames, values, schema, counts); expiring
    with ``older_than=0, orphans=True`` (no job runs now) removes every older snapshot, every shard
    of the jobs' (the killed ones' unlisted shards too) and the torn job's temporary file.
    """
    opts = result.storage_options
    before = tdgather.open(result.path, storage_options=opts)
    snap = tdgather.compact(result.path, opts)
    assert (snap.compacted, snap.added, snap.frames) == (result.snapshots[-1].version, 0, len(result.expected))
    ds = check_newest(result)  # every frame once, bit for bit, the counts as before
    assert ds.schema == before.schema and len(ds.index["shards"]) == 1
    gone = tdgather.expire(result.path, opts, older_than=0, orphans=True)
    assert gone.snapshots == tuple(s.version for s in result.snapshots) and gone.kept == (snap.version,)
    ds = check_newest(result)
    left = sorted(n for n in store_at(result.path, opts).list() if not JOB_MARK_NAME.fullmatch(n))
    assert left == sorted([*ds.index["shards"], snapshot_name(snap.version)]), left
    for v in result.contents:  # expired: refused, listing the one there is
        with pytest.raises(OutputError, match=rf"no snapshot version={v} \(there are: {snap.version}\)"):
            tdgather.open(result.path, version=v, storage_options=opts)


def test_sixteen_jobs_killed_and_rerun_in_a_directory_keep_every_frame_once(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    compact_and_expire(run_bar(str(tmp_path / "ds"), markers, seed=16))


def test_sixteen_jobs_killed_and_rerun_on_s3_keep_every_frame_once(tmp_path, url, s3):
    markers = tmp_path / "markers"
    markers.mkdir()
    compact_and_expire(run_bar(url, markers, seed=61, storage_options=s3))
