"""Names and versions: the dataset's files, the format's versions, and a group's tensors in a shard.

Version 2 names each leaf by its path, so that
``safe_open(shard).keys()`` says what is inside: a group ``g0`` of frames
``{"depth": ..., "det": {"boxes": ...}, "label": "cat"}`` holds

- ``g0:frame_idx``: int64 ``[N]``;
- ``g0.depth``, ``g0.det.boxes``, ``g0.label``: a tensor leaf, or a JSON leaf's UTF-8 lines;
  a plain tensor frame (no keys) is ``g0`` itself;
- ``<name>:offsets``: int64 ``[N+1]`` beside a ragged leaf's values and a JSON leaf's lines.

Each key of the path is escaped, so that names never collide: ``%``, ``.``, ``:`` and every
character that is not printable ASCII are written as ``%XX`` (their UTF-8 bytes), and an empty
key as ``%``. So ``.`` only ever separates keys and ``:`` only ever starts a suffix.

Version 1 named leaves by position: ``g0.frame_idx``, ``g0.leaf<j>``, ``g0.json<j>``, and
``<name>.offsets``. The reader still reads it.

The shard file names and the format's versions are here too: every writer and reader takes them
from this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..core.frames import Layout

__all__ = [
    "CHECKSUM_VERSION",
    "CRC32_MAX",
    "CRC32_VERSION",
    "RAGGED_VERSION",
    "SCHEMA_VERSION",
    "RUN_TAG",
    "shard_run",
    "shard_tag",
    "FORMAT",
    "GROUP_NAME",
    "INCOMPLETE_NAME",
    "INDEX_NAME",
    "INDEX_VERSION",
    "OURS",
    "RUN_NAME",
    "SHA256",
    "SHARD_NAME",
    "SHARD_PATTERN",
    "SHARD_VERSION",
    "SHARD_VERSIONS",
    "SNAPSHOT_NAME",
    "JOB_MARK_NAME",
    "VERSIONS",
    "WRITERS_VERSION",
    "GroupNames",
    "escape_key",
    "group_names",
    "index_version",
    "next_number",
    "shard_name",
    "shard_numbers",
    "shard_order",
    "snapshot_name",
    "job_mark_name",
]

_SAFE = frozenset(chr(c) for c in range(0x20, 0x7F)) - {"%", ".", ":"}


def escape_key(key: str) -> str:
    """One key of a leaf's path, as it appears in a tensor name.

    >>> escape_key("det"), escape_key("a.b"), escape_key("50%"), escape_key(""), escape_key("é")
    ('det', 'a%2Eb', '50%25', '%', '%C3%A9')
    """
    if not key:
        return "%"
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in key)


@dataclass(frozen=True)
class GroupNames:
    """A group's tensor names: its frame indexes, each tensor leaf, each JSON leaf, and offsets."""

    frame_idx: str
    leaves: tuple[str, ...]
    json: tuple[str, ...]
    offsets_suffix: str

    def offsets(self, name: str) -> str:
        """The offsets beside a ragged leaf's values or a JSON leaf's lines."""
        return name + self.offsets_suffix


def group_names(group: str, layout: Layout, version: int) -> GroupNames:
    """The tensor names of group ``group`` (``g<k>``) of ``layout`` in a shard of index ``version``.

    >>> from tdgather.core.frames import Leaf
    >>> import torch
    >>> layout = Layout("tree", None, (Leaf(("det", "boxes"), torch.float32, (4,), True),), (("label",),))
    >>> n = group_names("g0", layout, 2)
    >>> n.frame_idx, n.leaves, n.json, n.offsets(n.leaves[0])
    ('g0:frame_idx', ('g0.det.boxes',), ('g0.label',), 'g0.det.boxes:offsets')
    >>> group_names("g0", layout, 1).leaves, group_names("g0", layout, 1).offsets("g0.leaf0")
    (('g0.leaf0',), 'g0.leaf0.offsets')
    """
    if version == 1:
        return GroupNames(
            f"{group}.frame_idx",
            tuple(f"{group}.leaf{j}" for j in range(len(layout.leaves))),
            tuple(f"{group}.json{j}" for j in range(len(layout.nontensor))),
            ".offsets",
        )

    def name(path: tuple[str, ...]) -> str:
        return ".".join([group, *map(escape_key, path)])

    return GroupNames(
        f"{group}:frame_idx",
        tuple(name(leaf.path) for leaf in layout.leaves),
        tuple(name(path) for path in layout.nontensor),
        ":offsets",
    )


# ---- files and versions ---------------------------------------------------------------------------

FORMAT = "tdgather"  # the index's and every shard's "format"
INDEX_VERSION = 3  # the index version a single writer writes (3: shards record their segments, run and attempt)
WRITERS_VERSION = 4  # ... several writers: shard names carry the writer
CHECKSUM_VERSION = 5  # ... shards listed with their size (and sha256); names may carry their run
# every writer since: a filename's segments may be in groups whose layouts differ in a leaf's first dim, or in
# whether it is ragged (the leaf reads as ragged)
RAGGED_VERSION = 6
CRC32_VERSION = 7  # ... a local directory's shards listed with their CRC-32 too
SCHEMA_VERSION = 8  # ... the index records the dataset's schema: its frame types, each leaf's type in them
VERSIONS = (1, 2, INDEX_VERSION, WRITERS_VERSION, CHECKSUM_VERSION, RAGGED_VERSION, CRC32_VERSION, SCHEMA_VERSION)
SHARD_VERSION = "2"  # a shard's __metadata__.version: how its tensors are named (below)
SHARD_VERSIONS = ("1", SHARD_VERSION)  # the shard versions this tdgather reads
INDEX_NAME = "tdgather.index.json"  # written last: its presence means "complete"
INCOMPLETE_NAME = "tdgather.incomplete.json"  # what a failed run saved: in <name>.partial, or beside (a URL)
RUN_NAME = "tdgather.run.json"  # the run that opened last, written before any shard (`tdgather.storage.runmark`)
# shard-NNNNN, or shard-WWWWW-NNNNN (writer W); in an object store .RRRRRRRRRRRR-A before the suffix: the
# first 12 hex digits of the run id and the attempt, so no run or attempt ever overwrites another's object
SHARD_PATTERN = r"shard-[0-9]{5,}(-[0-9]{5,})?(\.[0-9a-f]{12}-[0-9]{1,9})?\.safetensors"
SHARD_NAME = re.compile(SHARD_PATTERN)
# snapshot N of a dataset that jobs append to (`tdgather.storage.append`): an index, written once, never replaced
SNAPSHOT_PATTERN = r"tdgather\.snapshot-([0-9]{8,})\.json"
SNAPSHOT_NAME = re.compile(SNAPSHOT_PATTERN)
# an attempt of a job that appends and resumes (`tdgather.storage.jobmark`): the hash of its key, the attempt
JOB_MARK_PATTERN = r"tdgather\.job-([0-9a-f]{16})-([0-9]{4,})\.json"
JOB_MARK_NAME = re.compile(JOB_MARK_PATTERN)
# every name tdgather writes into a dataset: the only files it ever replaces or removes
OURS = re.compile(
    "("
    + "|".join(
        [
            SHARD_PATTERN,
            SNAPSHOT_PATTERN,
            JOB_MARK_PATTERN,
            *(re.escape(n) for n in (INDEX_NAME, INCOMPLETE_NAME, RUN_NAME)),
        ]
    )
    + ")"
)
GROUP_NAME = re.compile(r"g[0-9]+")
SHA256 = re.compile(r"[0-9a-f]{64}")  # a shard's checksum, as the index lists it (version 5 on)
CRC32_MAX = 2**32 - 1  # a local shard's CRC-32 is an integer in 0..CRC32_MAX (version 7 on)


_NAME = re.compile(r"shard-([0-9]{5,})(?:-([0-9]{5,}))?(?:\.([0-9a-f]{12})-([0-9]{1,9}))?\.safetensors")
RUN_TAG = 12  # hex digits of the run id a tagged shard name carries


def job_mark_name(key_hash: str, attempt: int) -> str:
    """The mark of attempt ``attempt`` of the job whose key hashes to ``key_hash`` (`tdgather.storage.jobmark`).

    >>> JOB_MARK_NAME.fullmatch(job_mark_name("0123456789abcdef", 2)).groups()
    ('0123456789abcdef', '0002')
    """
    return f"tdgather.job-{key_hash}-{attempt:04d}.json"


def snapshot_name(number: int) -> str:
    """Snapshot ``number``'s file name (snapshot 0 is the dataset's ``tdgather.index.json``, when it has one).

    >>> snapshot_name(3), SNAPSHOT_NAME.fullmatch(snapshot_name(3))[1]
    ('tdgather.snapshot-00000003.json', '00000003')
    """
    return f"tdgather.snapshot-{number:08d}.json"


def shard_name(writer: int | None, number: int, tag: tuple[str, int] | None = None) -> str:
    """Writer ``writer``'s shard ``number`` (``None``: the single writer's ``shard-NNNNN``).

    ``tag``: ``(run, attempt)``, named in the shard (object stores, where nothing is renamed).
    """
    stem = f"shard-{number:05d}" if writer is None else f"shard-{writer:05d}-{number:05d}"
    return stem + (f".{tag[0][:RUN_TAG]}-{tag[1]}" if tag else "") + ".safetensors"


def shard_tag(name: str) -> tuple[str, int] | None:
    """A tagged shard name's ``(run prefix, attempt)``; None for an untagged name."""
    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"not a shard name: {name!r}")
    return None if m[3] is None else (m[3], int(m[4]))


def shard_run(name: str) -> str:
    """The run prefix (`RUN_TAG` hex digits) a tagged shard name carries; ``""`` for an untagged name.

    >>> shard_run("shard-00000.0123456789ab-2.safetensors"), shard_run("shard-00000.safetensors")
    ('0123456789ab', '')
    """
    tag = shard_tag(name)
    return "" if tag is None else tag[0]


def shard_numbers(name: str) -> tuple[int | None, int]:
    """A shard name's ``(writer, number)``; the single writer's shards have writer None."""
    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"not a shard name: {name!r}")
    return (None, int(m[1])) if m[2] is None else (int(m[1]), int(m[2]))


def next_number(names: Iterable[str], writer: int | None) -> int:
    """The number writer ``writer``'s next shard takes: past its every shard (a failed one may leave a gap)."""
    return 1 + max((n for w, n in map(shard_numbers, names) if w == writer), default=-1)


def index_version(shards: Mapping[str, Mapping]) -> int:
    """The index version of a dataset of these shards (name -> entry), as this tdgather writes it.

    8 (`SCHEMA_VERSION`: the index records its schema) when each is listed with its size, as every
    writer since version 5 lists them; else 4 when a name carries its writer, else 3 (no shard).
    """
    if shards and all("size" in entry for entry in shards.values()):
        return SCHEMA_VERSION
    return WRITERS_VERSION if any(shard_numbers(name)[0] is not None for name in shards) else INDEX_VERSION


def shard_order(name: str, attempt: int) -> tuple[int, int, int]:
    """Precedence of a shard's copies: (attempt, writer, number); the single writer's shards are writer 0."""
    writer, number = shard_numbers(name)
    return attempt, writer or 0, number
