"""Checking JSON that came from elsewhere (a peer's header, a file on disk) before it is used.

`FieldCheck` gives typed access to fields, each refusal naming the field and saying what was
expected and what came; `ProtocolCheck` raises `ProtocolError` naming the peer, and the format
layer's `Check` raises `DatasetError` naming the file. `strict_json` is the one parser of such
JSON. `decode_layout` reads a frame layout (the same description travels on the wire and is
stored in every shard).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..errors import ProtocolError
from .dtypes import dtype_from_name
from .frames import Layout

__all__ = ["FieldCheck", "ProtocolCheck", "decode_layout", "strict_json"]


def strict_json(raw: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON strictly: UTF-8, no NaN or Infinity, no duplicate keys.

    Raises ``UnicodeDecodeError`` or ``ValueError`` (``RecursionError`` past the parser's depth):
    the caller says whose JSON it was.

    >>> strict_json(b'{"a": [1, 2.5, null]}')
    {'a': [1, 2.5, None]}
    >>> strict_json('{"a": 1, "a": 2}')
    Traceback (most recent call last):
    ValueError: duplicate key 'a'
    """
    text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
    return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r:.60}")
            seen.add(k)
    return obj


class FieldCheck:
    """Typed access to the fields of parsed JSON that nothing vouches for; each refusal names the field.

    Subclasses say whose JSON it is: `ProtocolCheck` (a peer's header), `tdgather.format.check.Check`
    (a file on disk).
    """

    def fail(self, field: str, expected: str, got: Any) -> Exception:
        """The error for ``field``: what was expected, what came."""
        return ValueError(f"{field}: expected {expected}, got {got!r:.120}")

    def obj(self, x: Any, field: str, keys: set[str]) -> dict:
        """An object with exactly ``keys``."""
        if not isinstance(x, dict) or set(x) != keys:
            got = sorted(x) if isinstance(x, dict) else type(x).__name__
            raise self.fail(field, f"an object with keys {sorted(keys)}", got)
        return x

    def list(self, x: Any, field: str, length: int | None = None) -> list:
        """A list (of ``length`` items, if given)."""
        if not isinstance(x, list) or (length is not None and len(x) != length):
            raise self.fail(field, "a list" + (f" of {length} items" if length is not None else ""), x)
        return x

    def int(self, x: Any, field: str, hi: int = 2**62) -> int:
        """An integer in ``0..hi`` (a bool is not one)."""
        if type(x) is not int or not 0 <= x <= hi:
            raise self.fail(field, f"an integer in 0..{hi}", x)
        return x

    def str(self, x: Any, field: str) -> str:
        """A string."""
        if not isinstance(x, str):
            raise self.fail(field, "a string", x)
        return x

    def dtype(self, x: Any, field: str) -> torch.dtype:
        """The name of a dtype tdgather carries."""
        dt = dtype_from_name(x) if isinstance(x, str) else None
        if dt is None:
            raise self.fail(field, "a supported dtype name", x)
        return dt

    def shape(self, x: Any, field: str) -> tuple[int, ...]:
        """A shape: a list of non-negative integers."""
        return tuple(self.int(d, f"{field}[{i}]") for i, d in enumerate(self.list(x, field)))


class ProtocolCheck(FieldCheck):
    """`FieldCheck` for a peer's message header: refusals are `ProtocolError` naming the source rank."""

    def __init__(self, src: int) -> None:
        self.src = src

    def fail(self, field: str, expected: str, got: Any) -> ProtocolError:
        """The error for ``field`` of rank ``src``'s header."""
        return ProtocolError(self.src, field, f"expected {expected}, got {got!r:.120}")


def decode_layout(obj: Any, c: FieldCheck, field: str) -> Layout:
    """A layout description (``Layout.to_json``), every field checked before the `Layout` is made."""
    keys = {"kind", "cls", "leaves", "json"}
    c.obj(obj, field, keys | {"batch_dims"} if isinstance(obj, dict) and "batch_dims" in obj else keys)
    if obj["kind"] not in ("tensor", "tree"):
        raise c.fail(f"{field}.kind", "'tensor' or 'tree'", obj["kind"])
    if obj["cls"] is not None:
        c.str(obj["cls"], f"{field}.cls")
    for i, x in enumerate(c.list(obj["leaves"], f"{field}.leaves")):
        f = f"{field}.leaves[{i}]"
        ragged = isinstance(x, dict) and "ragged" in x
        c.obj(x, f, {"path", "dtype", "shape", "ragged"} if ragged else {"path", "dtype", "shape"})
        if ragged and x["ragged"] is not True:
            raise c.fail(f"{f}.ragged", "true (or no such key)", x["ragged"])
        [c.str(k, f"{f}.path") for k in c.list(x["path"], f"{f}.path")]
        c.dtype(x["dtype"], f"{f}.dtype"), c.shape(x["shape"], f"{f}.shape")
    for p in c.list(obj["json"], f"{field}.json"):
        [c.str(k, f"{field}.json") for k in c.list(p, f"{field}.json")]
    if "batch_dims" in obj:
        _check_batch_dims(obj, c, field)
    layout = Layout.from_json(obj)
    if layout.kind == "tensor" and (len(layout.leaves) != 1 or layout.leaves[0].path or layout.nontensor):
        raise c.fail(field, "one tensor leaf at the root for kind 'tensor'", obj)
    if layout.kind == "tree":  # paths `rebuild.rebuild` can set: distinct, non-empty, none inside another
        paths = sorted([leaf.path for leaf in layout.leaves] + list(layout.nontensor))
        for a, b in zip([None, *paths], paths, strict=False):
            if not b or (a is not None and b[: len(a)] == a):
                raise c.fail(f"{field}.leaves", "distinct non-empty paths, none inside another", [a, b])
    return layout


def _check_batch_dims(obj: dict, c: FieldCheck, field: str) -> None:
    """A tree's per-frame batch dims: non-empty, and what every tensor leaf's shape (none ragged) starts with."""
    f = f"{field}.batch_dims"
    dims = c.shape(obj["batch_dims"], f)
    if not dims:
        raise c.fail(f, "a non-empty list of dims (or no such key)", obj["batch_dims"])
    if obj["kind"] != "tree":
        raise c.fail(f, "no such key for kind 'tensor'", obj["batch_dims"])
    for i, x in enumerate(obj["leaves"]):  # each already checked
        if "ragged" in x:
            raise c.fail(f"{field}.leaves[{i}].ragged", "no such key with batch_dims (a ragged leaf has none)", True)
        if tuple(x["shape"][: len(dims)]) != dims:
            raise c.fail(f"{field}.leaves[{i}].shape", f"a shape that starts with batch_dims {list(dims)}", x["shape"])
