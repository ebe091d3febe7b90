"""What a shard may hold beyond its bytes: the size of its header, which readers bound.

safetensors refuses a file whose header is over 100,000,000 bytes. A shard's header holds, in
its ``__metadata__``, a segment record per filename (`tdgather.format.records.ShardRecord`), so
a writer cuts a shard before those records reach `SHARD_HEADER_MAX`.
"""

from __future__ import annotations

__all__ = ["SHARD_HEADER_MAX", "records_bytes", "segment_record_bytes"]

SHARD_HEADER_MAX = 64 << 20  # the records' share; the rest of 100 MB is room for the tensor entries
RECORD_BYTES = 48  # at most what a segment record adds beside its filename: its numbers, brackets, commas


def segment_record_bytes(name: str) -> int:
    """At most the bytes a filename's segment record adds to a shard's header.

    The record is JSON inside a JSON string: a character takes at most 7 bytes (a control
    character, escaped twice); a printable ASCII name without quotes or backslashes, one.

    >>> segment_record_bytes("a.mp4"), segment_record_bytes('a"b')
    (53, 69)
    """
    if _plain(name):
        return len(name) + RECORD_BYTES
    return 7 * len(name.encode("utf-8")) + RECORD_BYTES


def records_bytes(names: list[str]) -> int:
    """`segment_record_bytes` summed over ``names``: one pass over their characters when all are plain.

    >>> records_bytes(["a.mp4", 'a"b'])
    122
    """
    joined = "".join(names)
    if _plain(joined):
        return len(joined) + RECORD_BYTES * len(names)
    return sum(map(segment_record_bytes, names))


def _plain(text: str) -> bool:
    """Printable ASCII without quotes or backslashes: a byte a character in a record, escaped twice."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text
