"""The records of a dataset on disk, one frozen dataclass each: what the index and the shards hold.

A dataset directory holds shards (``shard-NNNNN.safetensors``; with several writers
``shard-WWWWW-NNNNN.safetensors``; in an object store with the run and attempt before the suffix,
``shard-NNNNN.RRRRRRRRRRRR-A.safetensors``: `tdgather.format.names`) and, once complete,
``tdgather.index.json``: an `Index`. A failed run leaves ``tdgather.incomplete.json`` instead (the
same record, with a `Failure`). Every shard's
``__metadata__`` records its own part (`ShardRecord`), so a killed run can be read and resumed
from the shards alone. docs/format.md describes these records for a reader with only
safetensors; a test checks that it names every field here, and nothing else.

The writers build records and write them with ``to_json()`` (``to_metadata()`` for a shard's own
record); ``from_json(obj, c, field)`` reads one from parsed JSON that nothing vouches for, checking
every field's type with the check ``c`` (whose errors name the file and the field). ``files`` and
``shards`` entries are only read back as records: the writer streams them from its catalog.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.checks import decode_layout
from ..core.frames import Layout
from .names import CRC32_MAX, FORMAT, GROUP_NAME, SHA256, SHARD_NAME, SHARD_VERSION

__all__ = ["Attempt", "Failure", "FileEntry", "IndexMeta", "Segment", "ShardEntry", "ShardRecord", "SnapshotRecord"]


@dataclass(frozen=True)
class Segment:
    """One filename's rows in one group of one shard: rows ``start .. start + frames - 1``.

    Attributes:
        shard: the shard file's name (no directory).
        group: the group, ``g<k>``: the frames of one layout in that shard.
        start: the first row.
        frames: how many rows (frames) from there.
    """

    shard: str
    group: str
    start: int
    frames: int

    def to_json(self) -> dict[str, Any]:
        """The segment as the index lists it."""
        return {"shard": self.shard, "group": self.group, "start": self.start, "frames": self.frames}

    @classmethod
    def from_json(cls, obj: Any, c: Any, where: str) -> Segment:
        """A segment read from the index, every field checked (the shard name too: never a path)."""
        return cls(*cls.check(obj, c, where))

    @staticmethod
    def check(obj: Any, c: Any, where: str) -> tuple[str, str, int, int]:
        """`from_json`'s checks alone: ``(shard, group, start, frames)``, no object made (an index lists millions)."""
        c.obj(obj, where, {"shard", "group", "start", "frames"})
        shard = c.str(obj["shard"], f"{where}.shard")
        if not SHARD_NAME.fullmatch(shard):
            raise c.fail(f"{where}.shard", "a shard file name like 'shard-00000.safetensors' (no directory)", shard)
        group = c.str(obj["group"], f"{where}.group")
        return shard, group, c.int(obj["start"], f"{where}.start"), c.int(obj["frames"], f"{where}.frames")


@dataclass(frozen=True)
class FileEntry:
    """One filename in the index: its frame count and its segments (one per shard group it spans).

    Attributes:
        frames: the filename's frames (the sum of its segments').
        segments: where they are; merged by ``frame_idx`` when read.
    """

    frames: int
    segments: tuple[Segment, ...]

    @classmethod
    def from_json(cls, obj: Any, c: Any, where: str) -> FileEntry:
        """A filename's entry read from the index, its frame count and every segment checked."""
        frames, segments = cls.check(obj, c, where)
        return cls(frames, tuple(Segment(*s) for s in segments))

    @staticmethod
    def check(obj: Any, c: Any, where: str) -> tuple[int, list[tuple[str, str, int, int]]]:
        """`from_json`'s checks alone: the frame count and each segment as `Segment.check` gives it."""
        c.obj(obj, where, {"frames", "segments"})
        listed = c.list(obj["segments"], f"{where}.segments")
        segments = [Segment.check(s, c, f"{where}.segments[{i}]") for i, s in enumerate(listed)]
        return c.int(obj["frames"], f"{where}.frames"), segments


@dataclass(frozen=True)
class ShardEntry:
    """One shard in the index.

    Attributes:
        frames: the frames its segments list.
        bytes: the tensor bytes of those frames.
        groups: each group's layout (``g<k>`` -> `Layout`), as its ``__metadata__`` records it.
        size: the shard file's size in bytes (index version 5 on; None before).
        sha256: the sha256 of the whole file, 64 lowercase hex digits (object stores, version 5 on; else None).
        crc32: the CRC-32 of the whole file (zlib's), an integer (local directories, version 7 on; else None).
    """

    frames: int
    bytes: int
    groups: Mapping[str, Layout]
    size: int | None = None
    sha256: str | None = None
    crc32: int | None = None

    @classmethod
    def from_json(cls, obj: Any, c: Any, where: str) -> ShardEntry:
        """A shard entry read from the index, every field and group layout checked."""
        keys = {"frames", "bytes", "groups"}
        if isinstance(obj, dict):
            sums = {"sha256", "crc32"} & set(obj)
            keys |= {"size"} & set(obj) | sums | ({"size"} if sums else set())
        c.obj(obj, where, keys)
        groups = {}
        for g, desc in c.mapping(obj["groups"], f"{where}.groups").items():
            if not GROUP_NAME.fullmatch(g):
                raise c.fail(f"{where}.groups", "group names like 'g0'", g)
            groups[g] = decode_layout(desc, c, f"{where}.groups[{g!r}]")
        size = c.int(obj["size"], f"{where}.size") if "size" in keys else None
        sha = obj.get("sha256")
        if "sha256" in keys and not (isinstance(sha, str) and SHA256.fullmatch(sha)):
            raise c.fail(f"{where}.sha256", "64 lowercase hex digits", sha)
        crc = c.int(obj["crc32"], f"{where}.crc32", CRC32_MAX) if "crc32" in keys else None
        frames, nbytes = c.int(obj["frames"], f"{where}.frames"), c.int(obj["bytes"], f"{where}.bytes")
        return cls(frames, nbytes, groups, size, sha, crc)


@dataclass(frozen=True)
class Failure:
    """How a run (or an attempt of it) failed.

    Attributes:
        type: the exception's type name.
        message: its message.
        rank: the rank it came from; None for a conflict between ranks.
    """

    type: str
    message: str
    rank: int | None

    def to_json(self) -> dict[str, Any]:
        """The failure as an index records it."""
        return {"type": self.type, "message": self.message, "rank": self.rank}

    @classmethod
    def from_json(cls, obj: Any, c: Any, where: str) -> Failure:
        """A failure read from an index, every field checked."""
        c.obj(obj, where, {"type", "message", "rank"})
        rank = None if obj["rank"] is None else c.int(obj["rank"], f"{where}.rank")
        return cls(c.str(obj["type"], f"{where}.type"), c.str(obj["message"], f"{where}.message"), rank)


@dataclass(frozen=True)
class Attempt:
    """One attempt of a run (a first run, then each ``resume=True``).

    Attributes:
        attempt: its number, from 1.
        frames: the frames it saved.
        failure: how it ended; None when it completed.
    """

    attempt: int
    frames: int
    failure: Failure | None = None

    def to_json(self) -> dict[str, Any]:
        """The attempt as the index's ``metadata.attempts`` lists it."""
        return {"attempt": self.attempt, "frames": self.frames, "failure": self.failure and self.failure.to_json()}

    @classmethod
    def from_json(cls, obj: Any, c: Any, where: str) -> Attempt:
        """An attempt read from an index, every field checked."""
        c.obj(obj, where, {"attempt", "frames", "failure"})
        failure = None if obj["failure"] is None else Failure.from_json(obj["failure"], c, f"{where}.failure")
        return cls(c.int(obj["attempt"], f"{where}.attempt"), c.int(obj["frames"], f"{where}.frames"), failure)


@dataclass(frozen=True)
class IndexMeta:
    """The index's ``metadata``: tdgather's keys, and the user's under ``user``.

    Attributes:
        total_frames: frames in the dataset.
        total_bytes: their tensor bytes.
        num_filenames: filenames in the dataset.
        run: the run's id (every shard records it too); index version 3 on.
        attempts: each attempt of the run.
        duplicates_dropped: copies of a frame dropped by the duplicates policy.
        duplicates: those copies counted (exact, inexact, largest difference).
        frames_per_rank: frames each rank sent (an incomplete record).
        failure: how the run failed (an incomplete record only).
        replaces: the run id of the dataset this one replaced in place (an object store, where the
            old shards are removed after the index is written: any left by a crash are that run's).
        user: the user's ``metadata=``, as given.
    """

    total_frames: int
    total_bytes: int
    num_filenames: int
    run: str | None = None
    attempts: tuple[Attempt, ...] = ()
    duplicates_dropped: int | None = None
    duplicates: Mapping[str, Any] | None = None
    frames_per_rank: Mapping[str, int] | None = None
    failure: Failure | None = None
    replaces: str | None = None
    user: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The metadata as the index holds it (keys that are None are left out)."""
        out: dict[str, Any] = {"user": dict(self.user)}
        for key in ("duplicates_dropped", "duplicates", "frames_per_rank", "run", "replaces"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.failure is not None:
            out["failure"] = self.failure.to_json()
        out["attempts"] = [a.to_json() for a in self.attempts]
        out.update(total_frames=self.total_frames, total_bytes=self.total_bytes, num_filenames=self.num_filenames)
        return out


@dataclass(frozen=True)
class ShardRecord:
    """What a shard's ``__metadata__`` (str -> str, as safetensors requires) records of itself.

    Attributes:
        shard: its own file name (a renamed shard is refused).
        groups: each group's layout description (``Layout.to_json()``), by group name.
        segments: ``[filename, group, start, frames]`` for every segment it holds.
        run: the run's id.
        attempt: the attempt that wrote it.
        version: how its tensors are named (see docs/format.md).
        format: always ``"tdgather"``.
    """

    shard: str
    groups: Mapping[str, Any]
    segments: list[list[Any]]
    run: str
    attempt: int
    version: str = SHARD_VERSION
    format: str = FORMAT

    def to_metadata(self) -> dict[str, str]:
        """The shard's ``__metadata__``: every value a string (JSON where it is structured)."""
        return {
            "format": self.format,
            "version": self.version,
            "shard": self.shard,
            "groups": json.dumps(self.groups),
            "segments": json.dumps(self.segments, ensure_ascii=False),  # what a resumed run reads back
            "run": self.run,
            "attempt": str(self.attempt),
        }


@dataclass(frozen=True)
class SnapshotRecord:
    """A snapshot's ``snapshot`` record: which snapshot of a dataset jobs append to, when, and by whom.

    Attributes:
        version: its number, the one in its file name (1, 2, ...).
        parent: the snapshot it was made from (its shards and filenames are all in this one); None
            for the first.
        run: the run id of the job that committed it.
        made: when, UTC, ISO 8601.
        host: the host the job ran on.
        job: the scheduler's id of the job (``SLURM_ARRAY_JOB_ID_TASK``, ``JOB_COMPLETION_INDEX``...), or None.
        added: the frames the job added.
        duplicates_dropped: frames the job sent that the parent already held (each frame is kept once).
        user: the job's ``metadata=`` (the dataset's ``metadata.user`` is the first commit's).
        compacted: for a compaction's snapshot, the snapshot whose frames it rewrote into new shards
            (`tdgather.compact`); None for a job's (absent in records written before compaction existed).
    """

    version: int
    parent: int | None
    run: str
    made: str
    host: str
    job: str | None
    added: int
    duplicates_dropped: int
    user: Mapping[str, Any] = field(default_factory=dict)
    compacted: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as the snapshot holds it."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__} | {"user": dict(self.user)}

    @classmethod
    def from_json(cls, obj: Any, c: Any, where: str) -> SnapshotRecord:
        """A snapshot record read from a file, every field checked."""
        fields = set(cls.__dataclass_fields__)
        c.obj(obj, where, fields if isinstance(obj, dict) and "compacted" in obj else fields - {"compacted"})
        parent = None if obj["parent"] is None else c.int(obj["parent"], f"{where}.parent")
        job = None if obj["job"] is None else c.str(obj["job"], f"{where}.job")
        compacted = obj.get("compacted")
        compacted = None if compacted is None else c.int(compacted, f"{where}.compacted")
        return cls(
            c.int(obj["version"], f"{where}.version"),
            parent,
            c.str(obj["run"], f"{where}.run"),
            c.str(obj["made"], f"{where}.made"),
            c.str(obj["host"], f"{where}.host"),
            job,
            c.int(obj["added"], f"{where}.added"),
            c.int(obj["duplicates_dropped"], f"{where}.duplicates_dropped"),
            c.mapping(obj["user"], f"{where}.user"),
            compacted,
        )
