"""Stage 2, the wire format: pack a store into one payload, validate and unpack.

A message is three tensors, in order on one peer's stream:

1. a prelude, ``int64[10]``: magic, version, kind, sequence number, header
   length, payload length, source rank, call number, destination rank, call digest;
2. a UTF-8 JSON header (absent when its length is 0);
3. at most one ``uint8`` payload (absent when its length is 0).

Every size is known before anything is allocated, and `decode_prelude` and
`decode_header` check every field first. The payload is rebuilt as views of the
one received buffer. No pickle: non-tensor values travel as JSON.

The call number (the count of tdgather calls on the group, `tdgather.transport.begin_call`),
the destination rank and the call digest (of the call's kind and path) tie every message to
one call, so a message of another call is refused, never merged. A data message with no
parts is a heartbeat.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from ._dtypes import dtype_from_name, dtype_name
from .errors import CallMismatchError, ProtocolError
from .frames import Layout, Part, gather_rows, scatter_rows
from .store import FrameStore

__all__ = [
    "ALIGN",
    "MAGIC",
    "PRELUDE_LEN",
    "VERSION",
    "DataHeader",
    "Kind",
    "Limits",
    "PartSpec",
    "Prelude",
    "TensorSpec",
    "check_call",
    "decode_header",
    "decode_json",
    "encode_json",
    "error_header",
    "local_parts",
    "pack",
    "unpack",
]

MAGIC = int.from_bytes(b"tdgather", "big")
VERSION = 2
PRELUDE_LEN = 10
ALIGN = 64  # every leaf starts at a multiple of this, so views of any dtype are aligned
_SMALL_CHUNK = 1 << 20  # below this average batch size, packing gathers rows in one kernel


class Kind(IntEnum):
    """Message kinds."""

    DATA = 1
    DONE = 2
    ERROR = 3


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
        check(kind in Kind._value2member_map_, "kind", "1 (data), 2 (done) or 3 (error)", kind)
        check(got_seq == seq, "seq", f"message number {seq}", got_seq)
        check(got_src == src, "src", f"rank {src}", got_src)
        check(0 <= header_len <= limits.max_header_bytes, "header_len", f"0..{limits.max_header_bytes}", header_len)
        check(
            0 <= payload_len <= limits.max_payload_bytes, "payload_len", f"0..{limits.max_payload_bytes}", payload_len
        )
        check(kind == Kind.DATA or payload_len == 0, "payload_len", "0 for a done or error message", payload_len)
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
class TensorSpec:
    """Where one tensor sits in the payload."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PartSpec:
    """One layout group of a data message."""

    layout: Layout
    files: tuple[str, ...]
    counts: tuple[int, ...]
    frame_idx: TensorSpec
    leaves: tuple[TensorSpec, ...]
    json: tuple[list, ...]


@dataclass(frozen=True)
class DataHeader:
    """The validated header of a data message."""

    parts: tuple[PartSpec, ...]

    @property
    def num_frames(self) -> int:
        """Frames announced by this message."""
        return sum(sum(p.counts) for p in self.parts)


def encode_json(obj: Any) -> bytes:
    """Encode a header: UTF-8 JSON, no NaN."""
    return json.dumps(obj, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def decode_json(raw: bytes, src: int, limits: Limits) -> Any:
    """Parse header bytes strictly: UTF-8, no NaN/Infinity, no duplicate keys, bounded depth."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen = [k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i])]
            raise ValueError(f"duplicate key {seen[0]!r}")
        return obj

    try:
        text = raw.decode("utf-8")
        if _depth(text) > limits.max_depth:
            raise ValueError(f"nesting deeper than {limits.max_depth}")
        return json.loads(text, parse_constant=no_constants, object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(src, "header", f"expected strict UTF-8 JSON, got invalid bytes ({e})") from e


def _depth(text: str) -> int:
    """Bracket nesting depth outside strings, found without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


class _Check:
    """Typed field access on a parsed header, raising ProtocolError naming the field."""

    def __init__(self, src: int) -> None:
        self.src = src

    def fail(self, field: str, expected: str, got: Any) -> ProtocolError:
        return ProtocolError(self.src, field, f"expected {expected}, got {got!r:.120}")

    def obj(self, x: Any, field: str, keys: set[str]) -> dict:
        if not isinstance(x, dict) or set(x) != keys:
            got = sorted(x) if isinstance(x, dict) else type(x).__name__
            raise self.fail(field, f"an object with keys {sorted(keys)}", got)
        return x

    def list(self, x: Any, field: str, length: int | None = None) -> list:
        if not isinstance(x, list) or (length is not None and len(x) != length):
            raise self.fail(field, "a list" + (f" of {length} items" if length is not None else ""), x)
        return x

    def int(self, x: Any, field: str, hi: int = 2**62) -> int:
        if type(x) is not int or not 0 <= x <= hi:
            raise self.fail(field, f"an integer in 0..{hi}", x)
        return x

    def str(self, x: Any, field: str) -> str:
        if not isinstance(x, str):
            raise self.fail(field, "a string", x)
        return x

    def dtype(self, x: Any, field: str) -> torch.dtype:
        dt = dtype_from_name(x) if isinstance(x, str) else None
        if dt is None:
            raise self.fail(field, "a supported dtype name", x)
        return dt

    def shape(self, x: Any, field: str) -> tuple[int, ...]:
        return tuple(self.int(d, f"{field}[{i}]") for i, d in enumerate(self.list(x, field)))


def decode_header(obj: Any, kind: Kind, src: int, payload_len: int) -> DataHeader | dict:
    """Validate a parsed header of ``kind``; data headers become a `DataHeader`.

    Every leaf must be a supported dtype, lie inside the payload, not overlap
    another, and have ``prod(shape) * itemsize == nbytes``.
    """
    c = _Check(src)
    if kind == Kind.DONE:
        c.int(c.obj(obj, "header", {"frames"})["frames"], "header.frames")
        return obj
    if kind == Kind.ERROR:
        c.obj(obj, "header", {"type", "message"})
        c.str(obj["type"], "header.type"), c.str(obj["message"], "header.message")
        return obj
    parts, ranges = [], []
    for i, p in enumerate(c.list(c.obj(obj, "header", {"parts"})["parts"], "header.parts")):
        f = f"header.parts[{i}]"
        c.obj(p, f, {"layout", "files", "counts", "frame_idx", "leaves", "json"})
        layout = _decode_layout(p["layout"], c, f"{f}.layout")
        files = tuple(c.str(s, f"{f}.files[]") for s in c.list(p["files"], f"{f}.files"))
        counts = tuple(c.int(n, f"{f}.counts[]") for n in c.list(p["counts"], f"{f}.counts", len(files)))
        if len(set(files)) != len(files) or 0 in counts:
            raise c.fail(f"{f}.files", "distinct filenames with at least one frame each", files)
        n = sum(counts)
        leaf_specs = c.list(p["leaves"], f"{f}.leaves", len(layout.leaves))
        idx_dtype = (
            torch.int32 if isinstance(p["frame_idx"], dict) and p["frame_idx"].get("dtype") == "int32" else torch.int64
        )
        wanted = [("frame_idx", p["frame_idx"], idx_dtype, ())] + [
            (f"leaves[{j}]", s, leaf.dtype, leaf.shape)
            for j, (s, leaf) in enumerate(zip(leaf_specs, layout.leaves, strict=True))
        ]
        specs = []
        for name, s, dt, frame_shape in wanted:
            field = f"{f}.{name}"
            spec = _decode_spec(s, c, field, payload_len)
            if spec.dtype != dt or spec.shape != (n, *frame_shape):
                got = f"{dtype_name(spec.dtype)}{list(spec.shape)}"
                raise c.fail(field, f"{dtype_name(dt)}{[n, *frame_shape]}", got)
            specs.append(spec)
            ranges.append((spec.offset, spec.nbytes, field))
        values = c.list(p["json"], f"{f}.json", len(layout.nontensor))
        for j, v in enumerate(values):
            c.list(v, f"{f}.json[{j}]", n)
        parts.append(PartSpec(layout, files, counts, specs[0], tuple(specs[1:]), tuple(values)))
    end = 0
    for offset, nbytes, field in sorted(ranges):
        if nbytes and offset < end:
            raise c.fail(field, "byte ranges that do not overlap", f"a range starting at {offset} before {end}")
        end = max(end, offset + nbytes)
    if payload_len > _aligned(end):  # nothing unannounced is allocated (a heartbeat announces 0 bytes)
        raise c.fail("prelude.payload_len", f"at most {_aligned(end)} (the end of the last leaf)", payload_len)
    return DataHeader(tuple(parts))


def _decode_spec(s: Any, c: _Check, field: str, payload_len: int) -> TensorSpec:
    c.obj(s, field, {"dtype", "shape", "offset", "nbytes"})
    dt, shape = c.dtype(s["dtype"], f"{field}.dtype"), c.shape(s["shape"], f"{field}.shape")
    offset, nbytes = c.int(s["offset"], f"{field}.offset"), c.int(s["nbytes"], f"{field}.nbytes")
    if math.prod(shape) * dt.itemsize != nbytes:
        raise c.fail(f"{field}.nbytes", f"prod(shape) * itemsize = {math.prod(shape) * dt.itemsize}", nbytes)
    if offset % ALIGN or offset + nbytes > payload_len:
        raise c.fail(f"{field}.offset", f"a multiple of {ALIGN} with offset + nbytes <= {payload_len}", offset)
    return TensorSpec(dt, shape, offset, nbytes)


def _decode_layout(obj: Any, c: _Check, field: str) -> Layout:
    c.obj(obj, field, {"kind", "cls", "leaves", "json"})
    if obj["kind"] not in ("tensor", "tree"):
        raise c.fail(f"{field}.kind", "'tensor' or 'tree'", obj["kind"])
    if obj["cls"] is not None:
        c.str(obj["cls"], f"{field}.cls")
    for i, x in enumerate(c.list(obj["leaves"], f"{field}.leaves")):
        f = f"{field}.leaves[{i}]"
        c.obj(x, f, {"path", "dtype", "shape"})
        [c.str(k, f"{f}.path") for k in c.list(x["path"], f"{f}.path")]
        c.dtype(x["dtype"], f"{f}.dtype"), c.shape(x["shape"], f"{f}.shape")
    for p in c.list(obj["json"], f"{field}.json"):
        [c.str(k, f"{field}.json") for k in c.list(p, f"{field}.json")]
    layout = Layout.from_json(obj)
    if layout.kind == "tensor" and (len(layout.leaves) != 1 or layout.leaves[0].path or layout.nontensor):
        raise c.fail(field, "one tensor leaf at the root for kind 'tensor'", obj)
    if layout.kind == "tree":  # paths `frames.rebuild` can set: distinct, non-empty, none inside another
        paths = sorted([leaf.path for leaf in layout.leaves] + list(layout.nontensor))
        for a, b in zip([None, *paths], paths, strict=False):
            if not b or (a is not None and b[: len(a)] == a):
                raise c.fail(f"{field}.leaves", "distinct non-empty paths, none inside another", [a, b])
    return layout


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(store: FrameStore) -> tuple[dict, torch.Tensor]:
    """Lay a store out as a data header and one contiguous ``uint8`` payload.

    1. plan: sort each layout group by (file, frame_idx);
    2. place every leaf at an aligned offset;
    3. copy each chunk's rows into place (a plain copy when they form one run).
    """
    plans = store.plan()
    parts, offset, jobs = [], 0, []
    for plan in plans:
        n = plan.num_frames
        specs = []
        idx_dtype = _index_dtype(plan.frame_idx)
        for j, (dt, shape) in enumerate([(idx_dtype, ())] + [(x.dtype, x.shape) for x in plan.layout.leaves]):
            nbytes = n * math.prod(shape) * dt.itemsize
            specs.append({"dtype": dtype_name(dt), "shape": [n, *shape], "offset": offset, "nbytes": nbytes})
            jobs.append((plan, j - 1, offset, nbytes, dt))
            offset = _aligned(offset + nbytes)
        parts.append(
            {
                "layout": plan.layout.to_json(),
                "files": plan.files,
                "counts": plan.counts,
                "frame_idx": specs[0],
                "leaves": specs[1:],
                "json": plan.json,
            }
        )
    payload = torch.empty(offset, dtype=torch.uint8)
    for plan, leaf, start, nbytes, dt in jobs:
        if leaf < 0:
            payload[start : start + nbytes].view(dt).copy_(plan.frame_idx)
            continue
        rows = payload[start : start + nbytes].view(plan.num_frames, nbytes // plan.num_frames)
        if len(plan.chunks) > 8 and nbytes < len(plan.chunks) * _SMALL_CHUNK:  # many small batches: one gather
            gather_rows(rows, torch.cat([c.tensors[leaf] for c in plan.chunks]), plan.order)
            continue
        for chunk, target in zip(plan.chunks, plan.targets, strict=True):
            scatter_rows(rows, target, chunk.tensors[leaf])
    return {"parts": parts}, payload


def _index_dtype(frame_idx: torch.Tensor) -> torch.dtype:
    """int32 on the wire when every index fits (4 bytes a frame saved), else int64."""
    fits = frame_idx.numel() == 0 or (int(frame_idx.min()) >= -(2**31) and int(frame_idx.max()) < 2**31)
    return torch.int32 if fits else torch.int64


def unpack(header: DataHeader, payload: torch.Tensor, rank: int) -> list[Part]:
    """Rebuild the parts of a validated data message as views of ``payload`` (frame_idx as int64)."""

    def view(s: TensorSpec) -> torch.Tensor:
        return payload[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)

    return [
        Part(
            rank,
            p.layout,
            list(p.files),
            torch.arange(len(p.files)).repeat_interleave(torch.tensor(p.counts, dtype=torch.int64)),
            view(p.frame_idx).to(torch.int64),
            [view(s) for s in p.leaves],
            list(p.json),
        )
        for p in header.parts
    ]


def local_parts(store: FrameStore, rank: int) -> list[Part]:
    """Rank dst's own frames as parts: views of its chunks when they are large, else packed (one copy).

    Large chunks go to the merge as they are, so whole files stay views and split ones are copied
    once. Many small chunks are packed first: one sorted gather beats a scatter per chunk.
    """
    if store.nbytes >= store.num_chunks * _SMALL_CHUNK:
        return store.parts(rank)
    header, payload = pack(store)
    return unpack(decode_header(header, Kind.DATA, rank, payload.numel()), payload, rank)


def error_header(e: BaseException, limit: int = 16384) -> dict:
    """The header of an ``error`` message: the exception's type name and message, as JSON."""
    message = str(e)
    return {"type": type(e).__name__, "message": message if len(message) <= limit else message[:limit] + " [...]"}
