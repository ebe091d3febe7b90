"""Stage 2, the wire format: the messages of a stream, and their validation.

A message is at most three tensors, in order on one peer's stream:

1. a prelude, ``int64[10]``: magic, version, kind, sequence number, header
   length, payload length, source rank, call number, destination rank, call digest;
2. a UTF-8 JSON header (absent when its length is 0);
3. at most one ``uint8`` payload (absent when its length is 0).

Frames travel as a ``data`` message followed by its ``piece`` messages:

- ``data``: the header names the filenames and, per layout group, its rows, JSON leaves and
  how each tensor leaf is cut into pieces; the payload is the frame index (frame_idx,
  (file id, row count) runs, and each ragged leaf's rows per frame), so rank dst can place
  every row before any frame arrives;
- ``piece``: no header; the payload is the rows a piece holds of one leaf, in the sender's
  order (batches as the sender holds them, small ones joined), with the length announced.
  A ragged leaf's pieces hold its values' rows (``N_i`` per frame); no padding is sent.

Every size is known before anything is allocated, and `Prelude.decode` and `decode_header`
check every field first. No pickle: non-tensor values travel as JSON.

The call number (the count of tdgather calls on the group, `tdgather.comm.transport.begin_call`),
the destination rank and the call digest (of the call's kind and path) tie every message to
one call, so a message of another call is refused, never merged. A data message with no
groups is a heartbeat.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from ..core.checks import ProtocolCheck, decode_layout, strict_json
from ..core.frames import Layout
from ..errors import CallMismatchError, ProtocolError

__all__ = [
    "ALIGN",
    "HEARTBEAT",
    "MAGIC",
    "PRELUDE_LEN",
    "VERSION",
    "DataHeader",
    "GroupSpec",
    "Kind",
    "Limits",
    "Prelude",
    "check_call",
    "decode_header",
    "decode_index",
    "decode_json",
    "encode_json",
    "error_header",
    "index_offsets",
    "shm_offsets",
]

MAGIC = int.from_bytes(b"tdgather", "big")
HEARTBEAT = {"files": [], "groups": []}  # the header of an empty data message
VERSION = 8  # 4: ragged leaves (elems, lengths); 5: the ready answer may carry what a resumed run saved;
# 6: a data message may name a shared memory file that holds its pieces (same host), the ready answer the host;
# 7: gather opens with rank dst's ready answer; a same-host sender may write its rows into rank dst's result;
# an shm file may be kept (rank dst hands it back); 8: a block writer's ``done`` carries its ``report`` (was ``part``)
PRELUDE_LEN = 10
ALIGN = 64  # every index tensor starts at a multiple of this, so its views are aligned


class Kind(IntEnum):
    """Message kinds."""

    DATA = 1
    DONE = 2
    ERROR = 3
    PIECE = 4


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


@dataclass(frozen=True)
class Limits:
    """Caps checked before any allocation on the receive path."""

    max_header_bytes: int = 256 << 20
    max_payload_bytes: int = _physical_memory()
    max_depth: int = 16


@dataclass(frozen=True)
class Prelude:
    """The fixed-size start of every message."""

    kind: Kind
    seq: int
    header_len: int
    payload_len: int
    src: int
    call: int = 0
    dst: int = 0
    digest: int = 0

    def encode(self) -> torch.Tensor:
        """Return the prelude as the ``int64[10]`` tensor that goes on the wire."""
        fields = [MAGIC, VERSION, int(self.kind), self.seq, self.header_len, self.payload_len, self.src]
        return torch.tensor([*fields, self.call, self.dst, self.digest], dtype=torch.int64)

    @staticmethod
    def decode(t: torch.Tensor, src: int, seq: int, limits: Limits) -> Prelude:
        """Validate a received prelude from group rank ``src``, expected number ``seq``.

        Its call is checked by `check_call` once the whole message is read, so that the stream
        stays in step and the peer's sends complete.
        """
        magic, version, kind, got_seq, header_len, payload_len, got_src, *got_call = t.tolist()

        def check(ok: bool, field: str, expected: str, got: Any) -> None:
            if not ok:
                raise ProtocolError(src, f"prelude.{field}", f"expected {expected}, got {got}")

        check(magic == MAGIC, "magic", hex(MAGIC), hex(magic & (2**64 - 1)))
        check(version == VERSION, "version", f"protocol version {VERSION} (same tdgather on every rank)", version)
        check(kind in Kind._value2member_map_, "kind", "1 (data), 2 (done), 3 (error) or 4 (piece)", kind)
        check(got_seq == seq, "seq", f"message number {seq}", got_seq)
        check(got_src == src, "src", f"rank {src}", got_src)
        check(0 <= header_len <= limits.max_header_bytes, "header_len", f"0..{limits.max_header_bytes}", header_len)
        check(
            0 <= payload_len <= limits.max_payload_bytes, "payload_len", f"0..{limits.max_payload_bytes}", payload_len
        )
        check(kind in (Kind.DATA, Kind.PIECE) or payload_len == 0, "payload_len", "0 for done or error", payload_len)
        check((kind == Kind.PIECE) == (header_len == 0), "header_len", "0 for a piece, else > 0", header_len)
        return Prelude(Kind(kind), got_seq, header_len, payload_len, got_src, *got_call)


def check_call(prelude: Prelude, call: tuple[int, int, int], label: str = "") -> None:
    """Refuse a message of another call: ``call`` is this rank's (number, dst, digest of kind and path).

    ``label`` describes this rank's call for the message (a peer's path is known only by its digest).
    """
    got = (prelude.call, prelude.dst, prelude.digest)
    if got == tuple(call):
        return
    fields = ("call number", "dst", "kind of call (gather or Collector) or Collector path")
    differ = [w for w, a, b in zip(fields, got, call, strict=True) if a != b]
    raise CallMismatchError(
        f"rank {prelude.src} is in another tdgather call than this rank: its {' and '.join(differ)} differ "
        f"(rank {prelude.src}: call {got[0]}, dst {got[1]}; this rank: call {call[0]}, dst {call[1]}"
        f"{', ' + label if label else ''}). A rank "
        "skipped a gather()/Collector or made an extra one, or called it with another dst or path; every rank of "
        "the group must make the same tdgather calls in the same order, even a rank with no frames, and pass a "
        "Collector the same path string (only rank dst writes there, but the path names the call on every rank: "
        "compute it once, not per rank, e.g. no per-rank timestamps)"
    )


@dataclass(frozen=True)
class GroupSpec:
    """One layout group of a data message: its rows, how its index is sent, how its leaves are cut."""

    layout: Layout
    rows: int
    index_dtype: torch.dtype  # of frame_idx on the wire: int32 when every index fits, else int64
    runs: int  # (file id, row count) runs that give each row's filename
    json: tuple[list, ...]
    pieces: tuple[tuple[int, ...], ...]  # per tensor leaf: the rows of each piece message, in order
    elems: tuple[int, ...] = ()  # per tensor leaf: its rows (``rows``; for a ragged leaf, sum N_i)

    @property
    def ragged(self) -> int:
        """The number of ragged leaves (each sends its frames' row counts in the index)."""
        return sum(leaf.ragged for leaf in self.layout.leaves)


@dataclass(frozen=True)
class DataHeader:
    """The validated header of a data message (no groups: a heartbeat).

    ``shm``: ``(name, size, keep)`` of the shared memory file that holds its pieces (`tdgather.comm.shm`),
    each tensor leaf at `shm_offsets`; None when the pieces follow as messages.
    """

    files: tuple[str, ...]
    groups: tuple[GroupSpec, ...]
    shm: tuple[str, int, bool] | None = None
    direct: bool = False  # the sender will write its rows into rank dst's result (`tdgather.comm.direct`)

    @property
    def num_frames(self) -> int:
        """Frames announced by this message."""
        return sum(g.rows for g in self.groups)

    @property
    def index_nbytes(self) -> int:
        """The length of the message's payload: every group's frame index."""
        return index_offsets([(g.rows, g.index_dtype.itemsize, g.runs, g.ragged) for g in self.groups])[-1]

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """The pieces, in order: ``(group, leaf, first row, rows)``; messages that follow, unless in a segment."""
        out = []
        for g, spec in enumerate(self.groups):
            for j, counts in enumerate(spec.pieces):
                start = 0
                for rows in counts:
                    out.append((g, j, start, rows))
                    start += rows
        return out


def shm_offsets(groups: list[tuple[Layout, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Where each tensor leaf's bytes start in a segment (groups in order, leaves in order), and its size.

    ``groups`` holds per group its layout and each leaf's rows (``elems``); each leaf starts at a
    multiple of `ALIGN`.
    """
    out, at = [], 0
    for layout, elems in groups:
        for leaf, n in zip(layout.leaves, elems, strict=True):
            at = _aligned(at)
            out.append(at)
            at += n * leaf.row_nbytes
    return out, at


def index_offsets(sizes: list[tuple[int, int, int, int]]) -> list[int]:
    """Where each group's frame_idx, runs and lengths start in a data payload, and (last) its length.

    ``sizes`` holds per group ``(rows, index itemsize, runs, ragged leaves)``. Per group:
    ``frame_idx [rows]`` (its index dtype), ``runs int64 [runs, 2]`` (file id, row count), then
    per ragged leaf ``lengths int64 [rows]``, each at a multiple of `ALIGN`. Returns three
    offsets per group (frame_idx, runs, the first lengths), then the total.
    """
    out, offset = [], 0
    for rows, itemsize, runs, ragged in sizes:
        out.append(offset)
        offset = _aligned(offset + rows * itemsize)
        out.append(offset)
        offset = _aligned(offset + runs * 16)
        out.append(offset)
        offset += ragged * _aligned(rows * 8)
    return [*out, offset]


def encode_json(obj: Any) -> bytes:
    """Encode a header: UTF-8 JSON, no NaN."""
    return json.dumps(obj, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def decode_json(raw: bytes, src: int, limits: Limits) -> Any:
    """Parse header bytes strictly: UTF-8, no NaN/Infinity, no duplicate keys, bounded depth."""
    try:
        # the parser's own recursion is bounded (RecursionError); the depth is checked on what it built
        obj = strict_json(raw)
        if _depth(obj, limits.max_depth) > limits.max_depth:
            raise ValueError(f"nesting deeper than {limits.max_depth}")
        return obj
    except RecursionError as e:  # deeper than the parser goes, and so than the limit
        raise ProtocolError(
            src, "header", f"expected strict UTF-8 JSON, got nesting deeper than {limits.max_depth}"
        ) from e
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(src, "header", f"expected strict UTF-8 JSON, got invalid bytes ({e})") from e


def _depth(obj: Any, limit: int) -> int:
    """How deep lists and objects nest in parsed JSON (more than ``limit``: found once past it), without recursion.

    >>> _depth({"a": [[1], "]]]"], "b": {}}, 16), _depth([[[]]], 1)
    (3, 2)
    """
    deepest, stack = 0, [(obj, 1)] if isinstance(obj, (list, dict)) else []
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        values = node.values() if isinstance(node, dict) else node
        stack.extend((v, depth + 1) for v in values if isinstance(v, (list, dict)))
    return deepest


def decode_header(obj: Any, kind: Kind, src: int, payload_len: int, limits: Limits | None = None) -> DataHeader | dict:
    """Validate a parsed header of ``kind``; data headers become a `DataHeader`.

    A data header announces its groups: each a layout, its row count, its index dtype and runs,
    its JSON leaves (one value per row) and how each tensor leaf is cut into piece messages
    (rows that sum to the group's; each piece under the payload cap). ``payload_len`` must be
    exactly the frame index the groups announce.
    """
    limits = limits or Limits()
    c = ProtocolCheck(src)
    # a ready answer may add "saved", "run", "host" and "memfd", a place answer "place", a writer's done
    # "report": their readers check them
    if kind == Kind.DONE:
        more = {"saved", "run", "report", "host", "memfd", "place"}
        keys = {"frames"} | (more & set(obj) if isinstance(obj, dict) else set())
        c.int(c.obj(obj, "header", keys)["frames"], "header.frames")
        return obj
    if kind == Kind.ERROR:
        c.obj(obj, "header", {"type", "message"})
        c.str(obj["type"], "header.type"), c.str(obj["message"], "header.message")
        return obj
    c.obj(obj, "header", {"files", "groups"} | ({"shm", "direct"} & set(obj) if isinstance(obj, dict) else set()))
    if "direct" in obj and obj["direct"] is not True:
        raise c.fail("header.direct", "true (the sender writes its rows into rank dst's result)", obj["direct"])
    files = tuple(c.str(s, "header.files[]") for s in c.list(obj["files"], "header.files"))
    if len(set(files)) != len(files):
        raise c.fail("header.files", "distinct filenames", [f for f in files if files.count(f) > 1][:3])
    groups = []
    for i, g in enumerate(c.list(obj["groups"], "header.groups")):
        f = f"header.groups[{i}]"
        c.obj(g, f, {"layout", "rows", "index", "runs", "json", "pieces", "elems"})
        layout = decode_layout(g["layout"], c, f"{f}.layout")
        rows = c.int(g["rows"], f"{f}.rows")
        if rows == 0:
            raise c.fail(f"{f}.rows", "at least 1", rows)
        if g["index"] not in ("int32", "int64"):
            raise c.fail(f"{f}.index", "'int32' or 'int64'", g["index"])
        runs = c.int(g["runs"], f"{f}.runs", rows)
        if runs == 0:
            raise c.fail(f"{f}.runs", f"1..{rows}", runs)
        values = c.list(g["json"], f"{f}.json", len(layout.nontensor))
        for j, v in enumerate(values):
            c.list(v, f"{f}.json[{j}]", rows)
        elems = tuple(c.int(n, f"{f}.elems[]") for n in c.list(g["elems"], f"{f}.elems", len(layout.leaves)))
        pieces = []
        for j, (counts, leaf) in enumerate(
            zip(c.list(g["pieces"], f"{f}.pieces", len(layout.leaves)), layout.leaves, strict=True)
        ):
            field = f"{f}.pieces[{j}]"
            if not leaf.ragged and elems[j] != rows:
                raise c.fail(f"{f}.elems[{j}]", f"{rows} (the rows of a leaf that is not ragged)", elems[j])
            row_bytes = leaf.row_nbytes
            counts = tuple(c.int(n, f"{field}[]") for n in c.list(counts, field))
            wanted = elems[j] if row_bytes else 0
            if 0 in counts or sum(counts) != wanted:
                raise c.fail(field, f"piece row counts >= 1 that sum to {wanted}", list(counts)[:8])
            if counts and max(counts) * row_bytes > limits.max_payload_bytes:
                raise c.fail(field, f"pieces of at most {limits.max_payload_bytes} bytes", max(counts) * row_bytes)
            pieces.append(counts)
        dtype = torch.int32 if g["index"] == "int32" else torch.int64
        groups.append(GroupSpec(layout, rows, dtype, runs, tuple(values), tuple(pieces), elems))
    shm = None
    if "shm" in obj:
        more = {"keep"} & set(obj["shm"]) if isinstance(obj["shm"], dict) else set()
        seg = c.obj(obj["shm"], "header.shm", {"name", "size"} | more)
        if seg.get("keep", True) is not True:
            raise c.fail("header.shm.keep", "true (the sender keeps the shm file: rank dst hands it back)", seg["keep"])
        size = shm_offsets([(g.layout, g.elems) for g in groups])[1]
        if c.int(seg["size"], "header.shm.size") != size or size > limits.max_payload_bytes:
            raise c.fail("header.shm.size", f"{size} (the bytes the groups announce)", seg["size"])
        shm = (c.str(seg["name"], "header.shm.name"), size, "keep" in seg)
    header = DataHeader(files, tuple(groups), shm, "direct" in obj)
    if payload_len != header.index_nbytes:  # nothing unannounced is allocated (a heartbeat announces 0 bytes)
        raise c.fail("prelude.payload_len", f"{header.index_nbytes} (the frame index the groups announce)", payload_len)
    return header


def decode_index(header: DataHeader, payload: torch.Tensor | None, src: int) -> list[tuple]:
    """Each group's ``(file_ids, frame_idx, lengths)``, checked: runs inside ``files``, lengths that sum right.

    ``file_ids`` and ``frame_idx`` are int64 ``[rows]``; ``lengths`` (as `tdgather.core.part.Part` holds
    it) is empty when no leaf is ragged, else has per tensor leaf its frames' row counts (int64
    ``[rows]``, each >= 0, summing to the leaf's ``elems``), or None for a leaf that is not ragged.
    """
    c = ProtocolCheck(src)
    offsets = index_offsets([(g.rows, g.index_dtype.itemsize, g.runs, g.ragged) for g in header.groups])
    out = []
    for i, g in enumerate(header.groups):
        at, runs_at, lengths_at = offsets[3 * i], offsets[3 * i + 1], offsets[3 * i + 2]
        frame_idx = payload[at : at + g.rows * g.index_dtype.itemsize].view(g.index_dtype).to(torch.int64)
        runs = payload[runs_at : runs_at + g.runs * 16].view(torch.int64).view(g.runs, 2)
        ids, lengths = runs[:, 0], runs[:, 1]
        if bool((ids < 0).any() | (ids >= len(header.files)).any()):
            raise c.fail(f"header.groups[{i}].runs[]", f"file ids in 0..{len(header.files) - 1}", ids.tolist()[:8])
        if bool((lengths < 1).any()) or int(lengths.sum()) != g.rows:
            raise c.fail(f"header.groups[{i}].runs[]", f"row counts >= 1 that sum to {g.rows}", lengths.tolist()[:8])
        leaf_lengths: list[torch.Tensor | None] = []
        for j, leaf in enumerate(g.layout.leaves):
            if not leaf.ragged:
                leaf_lengths.append(None)
                continue
            n = payload[lengths_at : lengths_at + g.rows * 8].view(torch.int64)
            lengths_at += _aligned(g.rows * 8)
            total = torch.cumsum(n, 0)  # each length <= elems <= 2**62: an overflow shows as a negative total
            if bool((n < 0).any() | (n > g.elems[j]).any() | (total < 0).any()) or int(total[-1]) != g.elems[j]:
                field = f"header.groups[{i}] lengths of leaf {j}"
                raise c.fail(field, f"row counts >= 0 that sum to {g.elems[j]} (elems[{j}])", n.tolist()[:8])
            leaf_lengths.append(n)
        out.append((torch.repeat_interleave(ids, lengths), frame_idx, leaf_lengths if g.ragged else []))
    return out


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def error_header(e: BaseException, limit: int = 16384) -> dict:
    """The header of an ``error`` message: the exception's type name and message, as JSON."""
    message = str(e)
    return {"type": type(e).__name__, "message": message if len(message) <= limit else message[:limit] + " [...]"}
