"""``python -m benchmarks.objects``: a Collector writing to an object store (``s3://``), against its limits.

A local S3 API endpoint (moto's ``ThreadedMotoServer`` on 127.0.0.1, in this process, reached
over HTTP through s3fs exactly as a user's ranks reach a bucket). For each world size W, in the
same run, the same total payload (W x ``--mb-per-rank`` MB of 64x256 float32 frames) is written by:

- ``collector_s3``: a W-rank local gloo world; every rank adds its frames (a few filenames per
  rank, batches of 32 frames) to ``tdgather.Collector("s3://bucket/.../ds", storage_options=...)``;
  rank 0 streams the shard up as a multipart upload (8 MiB parts, sha256 while streaming) and
  writes the index. Timed on rank 0 from a barrier to the end of ``close()``.
- ``s3fs_one_object``: the same bytes as ONE object, ``fs.pipe_file(path, data)`` from one process
  (a child, so that it does not share the server's interpreter): the endpoint's limit.
- ``collector_local``: the same Collector run to a local temporary directory (atomic rename).

Each method runs once to warm up (imports, the S3 client's session; its time is reported as
"first") and then ``--repeats`` times; seconds are the median. Ratios are times: above 1 is
slower than the baseline. The dataset of the last timed Collector run is read back through
``tdgather.open`` (untimed) and every frame compared with what was sent.

``--stage-mb N`` (default: 64, or the largest world's payload when smaller; 0 skips) times, in one
child process, the stages of one shard's upload: sha256 of the bytes alone, ``fs.pipe_file``,
the multipart calls by hand (``upload_part`` of 8 MiB parts, then ``complete_multipart_upload``
timed apart), an s3fs ``open("wb", block_size=8 MiB, autocommit=False)`` streaming write without
a hash, and ``ObjectStore.put`` (that write plus the sha256): where a gap between the Collector
and s3fs comes from.

Run ``python -m benchmarks.objects --help``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import logging
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

import tdgather
from tdgather.tools.launch import run_local_world

from .report import machine

FRAME = (64, 256)  # float32: 65,536 bytes a frame
FRAME_BYTES = 4 * FRAME[0] * FRAME[1]
FILES_PER_RANK = 4
BATCH = 32  # frames per add(): 2 MiB
CREDENTIALS = {"key": "testing", "secret": "testing"}
METHODS = ("collector_s3", "s3fs_one_object", "collector_local")


def frames_per_rank(mb: float) -> int:
    return max(FILES_PER_RANK, round(mb * 1e6 / FRAME_BYTES))


def rank_plan(rank: int, mb: float) -> dict[str, tuple[int, int]]:
    """This rank's files: ``{filename: (first global frame number, frame count)}``; frame idx 0..count-1."""
    n = frames_per_rank(mb)
    per, extra = divmod(n, FILES_PER_RANK)
    out, at = {}, rank * n
    for k in range(FILES_PER_RANK):
        count = per + (k < extra)
        out[f"video_{rank:03d}_{k}.mp4"] = (at, count)
        at += count
    return out


def value_of(frame: torch.Tensor | int) -> torch.Tensor | float:
    """The constant every pixel of global frame number ``frame`` holds (exact in float32)."""
    return frame * 0.5 + 1.0


def rank_batches(rank: int, mb: float) -> list[tuple[list[str], torch.Tensor, torch.Tensor]]:
    """This rank's add() calls, built before timing: (filenames, frame_idx, frames)."""
    names, idx, glob = [], [], []
    for name, (first, count) in rank_plan(rank, mb).items():
        names += [name] * count
        idx += range(count)
        glob += range(first, first + count)
    out = []
    for at in range(0, len(names), BATCH):
        g = torch.tensor(glob[at : at + BATCH], dtype=torch.float32)
        frames = value_of(g)[:, None, None].expand(len(g), *FRAME).contiguous()
        out.append((names[at : at + BATCH], torch.tensor(idx[at : at + BATCH]), frames))
    return out


def verify(path: str, opts: dict | None, world: int, mb: float) -> int:
    """Read the dataset back; the number of frames whose index and every value are what was sent."""
    ds = tdgather.open(path, storage_options=opts)
    plan = {name: span for rank in range(world) for name, span in rank_plan(rank, mb).items()}
    if sorted(ds) != sorted(plan):
        return 0
    good = 0
    for name, (first, count) in plan.items():
        got = ds[name]
        depth = got.frames["depth"]
        if got.frame_idx.tolist() != list(range(count)) or tuple(depth.shape) != (count, *FRAME):
            continue
        want = value_of(torch.arange(first, first + count, dtype=torch.float32))
        good += int((depth == want[:, None, None]).flatten(1).all(1).sum())
    return good


def collector_rank(base: str, opts: dict | None, mb: float, repeats: int, timeout: float) -> dict | None:
    """Every rank: one warm-up and ``repeats`` Collector runs to ``base/<i>/ds``; rank 0's figures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = rank_batches(rank, mb)
    runs = []
    for i in range(repeats + 1):
        path = f"{base}/{i}/ds"
        dist.barrier()
        t0 = time.perf_counter()
        with tdgather.Collector(path, storage_options=opts, progress=False, timeout=timeout) as col:
            for names, idx, frames in batches:
                col.add(names, idx, {"depth": frames})
        seconds = time.perf_counter() - t0
        if rank == 0:
            s = col.summary
            runs.append(
                {"seconds": seconds, "close": s.close_seconds, "frames": s.frames, "bytes": s.bytes, "shards": s.shards}
            )
        dist.barrier()
    if rank != 0:
        return None
    last = runs[-1]
    read_back = verify(f"{base}/{repeats}/ds", opts, world, mb)
    if opts is None:
        shutil.rmtree(base, ignore_errors=True)
    timed = runs[1:]
    return {
        "times": [r["seconds"] for r in timed],
        "first": runs[0]["seconds"],
        "close": statistics.median(r["close"] for r in timed),
        "frames": last["frames"],
        "bytes": last["bytes"],
        "shards": last["shards"],
        "read_back": read_back,
    }


def _fs(opts: dict):
    import s3fs

    return s3fs.S3FileSystem(**opts, skip_instance_cache=True)


def _payload(nbytes: int) -> bytes:
    return torch.arange(nbytes // 4, dtype=torch.float32).numpy().tobytes()


def s3fs_rank(base: str, opts: dict, nbytes: int, repeats: int) -> dict:
    """One process: one warm-up and ``repeats`` uploads of ``nbytes`` as one object with ``pipe_file``."""
    fs, data = _fs(opts), _payload(nbytes)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        fs.pipe_file(f"{base}/{i}", data)
        times.append(time.perf_counter() - t0)
    size = fs.size(f"{base}/{repeats}")
    return {"times": times[1:], "first": times[0], "bytes": size}


def stages_rank(bucket: str, opts: dict, nbytes: int, repeats: int) -> dict:
    """One process: the stages of uploading one ``nbytes`` shard, each timed (warm-up, then medians)."""
    from tdgather.storage.objects import BLOCK_BYTES, ObjectStore

    fs, data = _fs(opts), _payload(nbytes)
    chunk = 2 << 20  # what reaches ObjectStore.put: chunks of about the Collector's size
    view = memoryview(data)
    chunks = [view[at : at + chunk] for at in range(0, len(view), chunk)]
    store = ObjectStore(f"s3://{bucket}/stages/put", storage_options=opts)

    def sha256() -> None:
        h = hashlib.sha256()
        for c in chunks:
            h.update(c)

    def pipe(i: int) -> None:
        fs.pipe_file(f"{bucket}/stages/pipe/{i}", data)

    def stream(i: int) -> None:
        f = fs.open(f"{bucket}/stages/stream/{i}", "wb", block_size=BLOCK_BYTES, autocommit=False)
        for c in chunks:
            f.write(c)
        f.close()
        f.commit()

    def put(i: int) -> None:
        store.put(f"shard-{i}.safetensors", iter(chunks))

    parts = [data[at : at + BLOCK_BYTES] for at in range(0, len(data), BLOCK_BYTES)]
    done: list[float] = []

    def by_hand(i: int) -> None:
        """The multipart calls alone, on 8 MiB parts sliced beforehand; the complete call timed apart."""
        key = f"stages/hand/{i}"
        mpu = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        tags = []
        for n, part in enumerate(parts, 1):
            r = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=mpu["UploadId"], PartNumber=n, Body=part)
            tags.append({"PartNumber": n, "ETag": r["ETag"]})
        t0 = time.perf_counter()
        fs.call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=mpu["UploadId"],
            MultipartUpload={"Parts": tags},
        )
        done.append(time.perf_counter() - t0)

    out = {}
    stages = (("sha256", lambda i: sha256()), ("pipe_file", pipe), ("parts_8mib", by_hand), ("stream_8mib", stream),
              ("put", put))  # fmt: skip
    for name, fn in stages:
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[1:])
    out["complete"] = statistics.median(done[1:])
    out["parts_8mib"] -= out["complete"]
    fs.rm(f"{bucket}/stages", recursive=True)
    return out


class _Server:
    """moto's S3 server on a free port of 127.0.0.1, with one bucket."""

    def __enter__(self) -> _Server:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.opts = {"endpoint_url": f"http://{host}:{port}", **CREDENTIALS}
        self.bucket = f"bench-{uuid.uuid4().hex[:10]}"
        _fs(self.opts).mkdir(self.bucket)
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()


def versions() -> dict[str, str]:
    import botocore
    import fsspec
    import moto
    import s3fs

    m = machine()
    return {**m, "s3fs": s3fs.__version__, "fsspec": fsspec.__version__, "moto": moto.__version__,
            "botocore": botocore.__version__, "tdgather": tdgather.__version__}  # fmt: skip


def table(rows: list[dict]) -> list[str]:
    """The markdown table; time ratios against s3fs_one_object and collector_local of the same W."""
    by = {(r["world"], r["method"]): r for r in rows}
    lines = [
        "| method | W | MB | seconds | MB/s | first run s | close s | vs s3fs_one_object | vs collector_local |"
        " frames sent | frames read back |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        one, local = by.get((r["world"], "s3fs_one_object")), by.get((r["world"], "collector_local"))
        collector = r["method"] != "s3fs_one_object"
        cells = [
            r["method"],
            str(r["world"]),
            f"{r['bytes'] / 1e6:.1f}",
            f"{r['seconds']:.3f}",
            f"{r['bytes'] / 1e6 / r['seconds']:.1f}",
            f"{r['first']:.3f}",
            f"{r['close']:.3f}" if collector else "—",
            f"{r['seconds'] / one['seconds']:.2f}" if one else "—",
            f"{r['seconds'] / local['seconds']:.2f}" if local else "—",
            str(r["sent"]) if collector else "—",
            str(r["read_back"]) if collector else "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.objects", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    parser.add_argument("--mb-per-rank", type=float, default=32.0, help="MB of frames each rank adds")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up; the median")
    parser.add_argument("--stage-mb", type=float, help="MB of the one-shard stage timings (0: none)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", help="also write the table as markdown to this file")
    args = parser.parse_args(argv)
    stage_mb = args.stage_mb if args.stage_mb is not None else min(64.0, max(args.world) * args.mb_per_rank)
    t_all, load_before = time.perf_counter(), os.getloadavg()[0]
    rows: list[dict] = []
    stages: dict = {}
    with _Server() as srv, tempfile.TemporaryDirectory(prefix="tdgather-objects-") as scratch:
        for world in args.world:
            sent = world * frames_per_rank(args.mb_per_rank)
            nbytes = sent * FRAME_BYTES
            prefix = f"{srv.bucket}/w{world}"
            results = {
                "collector_s3": run_local_world(
                    collector_rank, world, f"s3://{prefix}/collector", srv.opts, args.mb_per_rank,
                    args.repeats, args.timeout, timeout=args.timeout,
                )[0],
                "s3fs_one_object": run_local_world(
                    s3fs_rank, 1, f"{prefix}/s3fs", srv.opts, nbytes, args.repeats, timeout=args.timeout
                )[0],
                "collector_local": run_local_world(
                    collector_rank, world, f"{scratch}/w{world}", None, args.mb_per_rank,
                    args.repeats, args.timeout, timeout=args.timeout,
                )[0],
            }  # fmt: skip
            _fs(srv.opts).rm(prefix, recursive=True)
            for method in METHODS:
                r = results[method]
                row = {"method": method, "world": world, "sent": sent, "close": 0.0, "read_back": 0, **r}
                row["seconds"] = statistics.median(r["times"])
                rows.append(row)
                print(
                    f"world {world} {method:<16} {row['seconds']:.3f} s, {row['bytes'] / 1e6 / row['seconds']:.1f} MB/s"
                    f" (first run {row['first']:.3f} s)"
                    + (f", {sent} frames sent, {row['read_back']} read back" if method != "s3fs_one_object" else ""),
                    flush=True,
                )
        if stage_mb > 0:
            nbytes = round(stage_mb * 1e6)
            stages = run_local_world(stages_rank, 1, srv.bucket, srv.opts, nbytes, args.repeats, timeout=args.timeout)
            stages = {"bytes": nbytes, **stages[0]}
    seconds, load = time.perf_counter() - t_all, (load_before, os.getloadavg()[0])
    lines = table(rows)
    if stages:
        lines += ["", *stage_table(stages)]
    print("\n".join(lines))
    if args.out:
        command = "python -m benchmarks.objects " + shlex.join(argv if argv is not None else sys.argv[1:])
        print(f"report: {write_report(lines, Path(args.out), command, args, seconds, load)}")
    return 0


def stage_table(stages: dict) -> list[str]:
    mb = stages["bytes"] / 1e6
    what = {
        "sha256": "hashlib.sha256 over the bytes, no upload",
        "pipe_file": "fs.pipe_file(path, data): one PUT (or 50 MiB parts above 100 MiB)",
        "parts_8mib": "create_multipart_upload + upload_part calls of 8 MiB parts (sliced beforehand), by hand",
        "complete": "complete_multipart_upload of those parts alone (the endpoint joins them)",
        "stream_8mib": "fs.open(wb, block_size=8 MiB, autocommit=False): write, close, commit; no hash",
        "put": "ObjectStore.put(name, chunks): 8 MiB parts, 3 in flight on S3, plus the sha256",
    }
    lines = [
        f"One shard of {mb:.1f} MB, from one process (chunks of 2 MiB), median:",
        "",
        "| stage | seconds | MB/s | vs pipe_file | what |",
        "|---|---|---|---|---|",
    ]
    for name, text in what.items():
        s = stages[name]
        lines.append(f"| {name} | {s:.3f} | {mb / s:.1f} | {s / stages['pipe_file']:.2f} | {text} |")
    return lines


def write_report(lines: list[str], md: Path, command: str, args, seconds: float, load: tuple) -> Path:
    m = versions()
    date = _dt.date.today().isoformat()
    header = [
        f"# tdgather to an object store (s3:// on a local moto server), {date}, {m['label']}",
        "",
        f"- command: `{command}` ({args.repeats} timed run(s) after one warm-up, medians; {seconds:.0f} s in all)",
        f"- machine: {m['cpu']}, nproc {os.cpu_count()}, {m['ram']}; {m['os']}; no GPU used; load average"
        f" (1 min) {load[0]:.2f} before, {load[1]:.2f} after",
        f"- versions: Python {m['python']}, torch {m['torch']}, s3fs {m['s3fs']}, fsspec {m['fsspec']},"
        f" botocore {m['botocore']}, moto {m['moto']}, safetensors {m['safetensors']}, tdgather {m['tdgather']}",
        f"- payload: W x {args.mb_per_rank:g} MB of 64x256 float32 frames ({FRAME_BYTES} bytes each), "
        f"{FILES_PER_RANK} filenames per rank, add() in batches of {BATCH} frames",
        "- endpoint: moto's ThreadedMotoServer on 127.0.0.1 in the benchmark's main process (a Python"
        " server: its own CPU cost per byte, on the same cores as the ranks)",
        "- seconds: rank 0's wall time from a barrier to the end of close() (collectors); one pipe_file call"
        " (s3fs_one_object, from a child process); first run: the warm-up's; close: rank 0's close() alone",
        "- vs columns: this row's seconds over the baseline's, same W (above 1: slower)",
        "- frames read back: frames of the last timed run whose frame_idx and every value match, through"
        " tdgather.open (untimed)",
        "",
    ]
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(header + lines) + "\n")
    return md


if __name__ == "__main__":
    sys.exit(main())
