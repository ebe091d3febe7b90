"""Many writers, one dataset: what each block's writer reports to the coordinator, checked as hostile input.

With ``Collector(path, ranks_per_writer=k)`` the ranks form blocks of k consecutive group ranks.
The first rank of each block is the block's writer: its peers send to it, and it writes their
frames into ``<path>.partial`` (which every writer must see: a shared filesystem) as shards of
its own, ``shard-WWWWW-NNNNN.safetensors`` (writer W's N-th shard). Every shard records its own
segments, run and attempt (`tdgather.storage.scan`). At close each writer sends the coordinator, rank dst,
its report in its ``done`` message: the names, frames, bytes and file sizes of its
shards, frames per rank and duplicate counts. That is metadata only: no frame crosses a writer's
link twice. The coordinator reads every shard's own record, resolves copies of one frame held
by several writers (`tdgather.storage.combine`), and writes the one index last.
Copies across writers are resolved by `tdgather.storage.combine`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.checks import ProtocolCheck
from ..core.duplicates import DuplicateCounts
from .names import CRC32_MAX, SHA256, SHARD_NAME, shard_name, shard_numbers

__all__ = ["check_report", "check_run", "counts_of"]


def check_report(obj: Any, src: int, writer: int) -> dict:
    """A writer's report (``done.report``), checked as hostile input: shard names of writer ``writer`` only, counts.

    ``{"shards": {name: {"frames", "bytes", "size"[, "sha256"][, "crc32"]}}, "frames_per_rank": [[rank, frames], ...],
    "duplicates": {"exact", "inexact", "max_abs_diff"}}``; raises `ProtocolError` naming ``src``.
    """
    c = ProtocolCheck(src)
    report = c.obj(obj, "done.report", {"shards", "frames_per_rank", "duplicates"})
    if not isinstance(report["shards"], dict):
        raise c.fail("done.report.shards", "an object: shard name -> frames, bytes, size, checksum", report["shards"])
    for name, entry in report["shards"].items():
        f = f"done.report.shards[{name!r}]"
        if not (SHARD_NAME.fullmatch(name) and shard_numbers(name)[0] == writer):
            raise c.fail(f, f"a shard name of writer {writer}, like {shard_name(writer, 0)!r}", name)
        checksums = {"sha256", "crc32"} & set(entry) if isinstance(entry, dict) else set()
        c.obj(entry, f, {"frames", "bytes", "size"} | checksums)
        for k in ("frames", "bytes", "size"):
            c.int(entry[k], f"{f}.{k}")
        if "sha256" in entry and not (isinstance(entry["sha256"], str) and SHA256.fullmatch(entry["sha256"])):
            raise c.fail(f"{f}.sha256", "64 lowercase hex digits", entry["sha256"])
        if "crc32" in entry:
            c.int(entry["crc32"], f"{f}.crc32", CRC32_MAX)
    for i, pair in enumerate(c.list(report["frames_per_rank"], "done.report.frames_per_rank")):
        rank, frames = c.list(pair, f"done.report.frames_per_rank[{i}]", 2)
        c.int(rank, f"done.report.frames_per_rank[{i}][0]"), c.int(frames, f"done.report.frames_per_rank[{i}][1]")
    d = c.obj(report["duplicates"], "done.report.duplicates", {"exact", "inexact", "max_abs_diff"})
    c.int(d["exact"], "done.report.duplicates.exact"), c.int(d["inexact"], "done.report.duplicates.inexact")
    if d["max_abs_diff"] != "inf" and (type(d["max_abs_diff"]) not in (int, float) or d["max_abs_diff"] < 0):
        raise c.fail("done.report.duplicates.max_abs_diff", "a number >= 0 or 'inf'", d["max_abs_diff"])
    return report


def check_run(obj: Any, src: int) -> tuple[str, int]:
    """The run and attempt a coordinator's ready answer gives its writers, checked: ``(run id, attempt)``."""
    c = ProtocolCheck(src)
    run = c.obj(obj, "done.run", {"id", "attempt"})
    if not (isinstance(run["id"], str) and 0 < len(run["id"]) <= 128):
        raise c.fail("done.run.id", "a run id (a string of 1 to 128 characters)", run["id"])
    if not (type(run["attempt"]) is int and 0 < run["attempt"] < 1 << 31):
        raise c.fail("done.run.attempt", "a positive integer", run["attempt"])
    return run["id"], run["attempt"]


def counts_of(obj: Mapping) -> DuplicateCounts:
    """`DuplicateCounts` from their JSON (`DuplicateCounts.to_json`), checked by `check_report`."""
    diff = obj["max_abs_diff"]
    return DuplicateCounts(obj["exact"], obj["inexact"], float("inf") if diff == "inf" else float(diff))
