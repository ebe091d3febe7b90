"""``python -m benchmarks.appends``: what a commit of a job appending to a shared dataset costs.

Two measurements, locally and on S3 (moto's ``ThreadedMotoServer`` on 127.0.0.1, reached through
s3fs over HTTP, as jobs reach a bucket), each against its baseline in the same run:

- ``concurrent``: J jobs (separate processes), each with its shards already written (one shard
  of ``--frames`` frames of ``float32[64]`` in its own filenames), call ``commit()`` at once (a
  barrier). Reported: each job's commit latency (median, max), the time from the barrier until
  the last commit, and the attempts lost to other jobs; the baseline is one job committing alone
  into the same dataset. Commits serialize: J at once cost about J commits in a row.
- ``listed``: one job committing into a dataset whose newest snapshot already lists S shards and
  F filenames (built by earlier appends, untimed): the commit's seconds against S and F; the
  baseline is the commit into an empty dataset. A commit reads the newest snapshot and writes a
  whole new one, so it costs O(S + F) bytes of JSON each way.
- ``compaction``: J jobs append frames of the same F filenames (each filename a segment per job),
  then ``tdgather.compact`` rewrites them: its seconds against saving the same frames in one run
  (the bytes written once), and the seconds to read every frame before and after.

Run ``python -m benchmarks.appends --help``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import torch

import tdgather
from tdgather.storage.writer import DatasetWriter

from .report import machine

CREDENTIALS = {"key": "testing", "secret": "testing"}


def _frames(job: int, frames: int, files: int) -> dict:
    """Job ``job``'s frames: ``frames`` frames of float32[64] over ``files`` filenames of its own."""
    return tdgather.gather(
        {
            f"job{job:05d}-{k:06d}.mp4": [(t, torch.full((64,), float(t))) for t in range(frames // files)]
            for k in range(files)
        }
    )


def _job(path: str, options: dict | None, job: int, frames: int, files: int, barrier, out) -> None:
    """A job: write its shard, wait for the others, commit; report (latency, snapshot, tries lost)."""
    kw = {"storage_options": options} if options else {}
    w = DatasetWriter(path, append=True, **kw)
    w.write(_frames(job, frames, files))
    barrier.wait()
    t = time.perf_counter()
    w.commit({})
    out.put((job, time.perf_counter() - t, w.out.snapshot))


def concurrent(path: str, options: dict | None, jobs: int, frames: int, files: int) -> dict:
    """J jobs committing at once (processes, after a barrier): each one's latency, and the whole."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(jobs + 1), ctx.Queue()
    procs = [ctx.Process(target=_job, args=(path, options, j, frames, files, barrier, out)) for j in range(jobs)]
    for p in procs:
        p.start()
    barrier.wait()
    t = time.perf_counter()
    got = [out.get(timeout=600) for _ in procs]
    whole = time.perf_counter() - t
    for p in procs:
        p.join(60)
    lat = sorted(x[1] for x in got)
    snaps = sorted(x[2] for x in got)
    return {"jobs": jobs, "median": statistics.median(lat), "max": lat[-1], "whole": whole, "snapshots": snaps}


def listed(path: str, options: dict | None, shards: int, files: int, frames_per_file: int = 1) -> float:
    """Seconds of one commit into a dataset already listing ``shards`` shards and ``files`` filenames."""
    kw = {"storage_options": options} if options else {}
    if shards:
        per = max(1, files // shards)
        for s in range(shards):  # one earlier job a shard (untimed)
            w = DatasetWriter(path, append=True, **kw)
            w.write(_frames(100000 + s, per * frames_per_file, per))
            w.commit({})
    w = DatasetWriter(path, append=True, **kw)
    w.write(_frames(0, 64, 8))
    t = time.perf_counter()
    w.commit({})
    return time.perf_counter() - t


def compaction(path: str, options: dict | None, jobs: int, files: int, frames: int) -> dict:
    """``jobs`` appends of ``files`` filenames each (all jobs sending frames of every filename), then one compaction.

    Timed: the compaction; the same frames saved by one run (the bytes written once: the baseline);
    reading every frame before and after (the reader's gain: one shard and one segment a filename).
    """
    kw = {"storage_options": options} if options else {}
    per = frames // jobs

    def share(job: int) -> dict:
        return {
            f"f{k:06d}.mp4": [(t, torch.full((64,), float(t))) for t in range(job * per, (job + 1) * per)]
            for k in range(files)
        }

    for job in range(jobs):  # untimed
        tdgather.save(tdgather.gather(share(job)), path, append=True, **kw)
    whole = {n: [x for job in range(jobs) for x in share(job)[n]] for n in share(0)}
    t = time.perf_counter()
    tdgather.save(tdgather.gather(whole), path + "-one-run", **kw)
    one_run = time.perf_counter() - t
    read_before = _read_all(path, options)
    t = time.perf_counter()
    tdgather.compact(path, options)
    took = time.perf_counter() - t
    return {"compact": took, "one_run": one_run, "before": read_before, "after": _read_all(path, options)}


def _read_all(path: str, options: dict | None) -> float:
    t = time.perf_counter()
    ds = tdgather.open(path, storage_options=options)
    for name in ds:
        ds[name]
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.appends", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="1,4,16", help="jobs committing at once (comma-separated)")
    parser.add_argument("--frames", type=int, default=256, help="frames a job commits (concurrent)")
    parser.add_argument("--files", type=int, default=16, help="filenames a job commits (concurrent)")
    parser.add_argument(
        "--listed", default="0:0,16:10000,64:100000", help="shards:filenames already listed (comma-separated)"
    )
    parser.add_argument("--stores", default="local,s3", help="local, s3 (moto), or both")
    parser.add_argument(
        "--compact", default="16:1000:64", help="jobs:filenames:frames a filename, appended then compacted ('' skips)"
    )
    args = parser.parse_args(argv)
    print(f"- command: `python -m benchmarks.appends {' '.join(argv if argv is not None else sys.argv[1:])}`")
    print(f"- machine: {machine()}")
    print(f"- versions: Python {sys.version.split()[0]}, torch {torch.__version__}")
    print()
    print("| store | measurement | setting | commit s (median) | commit s (max) | whole s | x baseline | snapshots |")
    print("|---|---|---|---|---|---|---|---|")
    for store in args.stores.split(","):
        with _where(store) as (root, options):
            base = None
            for jobs in map(int, args.jobs.split(",")):
                r = concurrent(root(), options, jobs, args.frames, args.files)
                base = base or r["median"]
                snaps = f"{r['snapshots'][0]}..{r['snapshots'][-1]}"
                print(
                    f"| {store} | concurrent | {jobs} jobs at once | {r['median']:.3f} | {r['max']:.3f} | "
                    f"{r['whole']:.3f} | {r['whole'] / base:.1f}x one commit alone | {snaps} |"
                )
            first = None
            for spec in args.listed.split(","):
                shards, files = map(int, spec.split(":"))
                t = listed(root(), options, shards, files)
                first = first or t
                print(
                    f"| {store} | listed | {shards} shards, {files} filenames listed | {t:.3f} | | | "
                    f"{t / first:.1f}x into an empty dataset | |"
                )
            if args.compact:
                jobs, files, frames = map(int, args.compact.split(":"))
                c = compaction(root(), options, jobs, files, frames)
                print(
                    f"| {store} | compaction | {jobs} jobs x {files} filenames, {frames} frames each | "
                    f"{c['compact']:.3f} | | | {c['compact'] / c['one_run']:.2f}x saving the frames in one run "
                    f"({c['one_run']:.3f} s); "
                    f"reading every frame {c['before']:.3f} s before, {c['after']:.3f} s after | |"
                )
    return 0


class _where:
    """A fresh dataset location per measurement: a local temporary directory, or a new S3 bucket on moto."""

    def __init__(self, store: str) -> None:
        self.store = store

    def __enter__(self):
        if self.store == "local":
            self._tmp = tempfile.mkdtemp(prefix="tdgather-appends-")
            return (lambda: f"{self._tmp}/{uuid.uuid4().hex[:8]}"), None
        import logging

        import s3fs
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line a request otherwise

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        options = {"endpoint_url": f"http://{host}:{port}", **CREDENTIALS}
        bucket = f"b-{uuid.uuid4().hex[:10]}"
        s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(bucket)
        return (lambda: f"s3://{bucket}/{uuid.uuid4().hex[:8]}"), options

    def __exit__(self, *exc) -> None:
        if self.store == "local":
            shutil.rmtree(self._tmp, ignore_errors=True)
        else:
            self._server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
