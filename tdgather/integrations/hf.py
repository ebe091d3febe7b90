"""Hugging Face ``datasets``: a saved dataset as a ``datasets.Dataset``, one row per frame (extra ``hf``).

`to_hf` builds it with ``filename``, ``frame_idx`` and one typed column per leaf (`hf_features`
gives the types); everything read from disk goes through `tdgather.storage.reader`'s checks.
Users call it as ``ds.to_hf(...)``: the package (``tdgather/__init__.py``) makes this function
that method of `tdgather.Dataset`, since the reader, in the storage layer, imports no integration.
``tdgather export-hf`` writes the result to disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..core.dtypes import dtype_name
from ..core.flatten import flatten
from ..core.frames import Layout
from ..core.ragged import Ragged
from ..errors import ExportError, TdgatherError
from ..storage.reader import Dataset
from ..storage.segments import read_rows
from ..storage.views import column_label

__all__ = ["hf_features", "to_hf"]

_RESERVED = ("filename", "frame_idx")
# dtypes Arrow has no type for: stored as float32, which holds every one of their values exactly
_WIDENED = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}
_MAX_ARRAY_DIMS = 5  # datasets has Array2D .. Array5D


def _json_only(layout: Layout) -> Layout:
    """A layout with only the JSON leaves: `read_rows` then reads frame indexes and JSON lines."""
    return Layout(layout.kind, layout.cls, (), layout.nontensor)


@dataclass(frozen=True)
class _Column:
    """One leaf column: where it is in a frame, what it holds, and the filename that first had it.

    ``shape`` holds None for a dim that differs between filenames; ``as_json``: the filenames'
    leaves differ in their number of dims (or a tensor in one is JSON in another), so the column
    holds each value as JSON (nested lists).
    """

    path: tuple[str, ...]
    dtype: torch.dtype | None  # None: a JSON leaf
    shape: tuple[int | None, ...]
    ragged: bool
    first: str
    as_json: bool = False

    def signature(self) -> tuple:
        return self.dtype, self.shape, self.ragged, self.as_json

    def describe(self) -> str:
        if self.dtype is None or self.as_json:
            return "json"
        dims = ["*"] * self.ragged + ["*" if d is None else str(d) for d in self.shape]
        return f"{dtype_name(self.dtype)}[{', '.join(dims)}]"

    def joined(self, other: _Column) -> _Column:
        """One column for two filenames' leaves of one name that differ: one type both fit in, never a refusal.

        Another dtype: the one both promote to (``torch.promote_types``); another size of a dim: that
        dim varies (None); another number of dims, raggedness, or a tensor against JSON: JSON values.
        """
        if self.as_json or other.as_json or None in (self.dtype, other.dtype):
            return replace(self, as_json=True)
        if len(self.shape) != len(other.shape) or self.ragged != other.ragged:
            return replace(self, as_json=True)
        shape = tuple(a if a == b else None for a, b in zip(self.shape, other.shape, strict=True))
        return replace(self, dtype=torch.promote_types(self.dtype, other.dtype), shape=shape)


def _columns(dataset: Dataset, names: Sequence[str]) -> dict[str, _Column]:
    """Every leaf of every filename as a column (dotted key; a plain tensor frame is ``frames``).

    Two filenames whose leaves of one name differ get one column both fit in (`_Column.joined`).

    Raises:
        ExportError: a leaf named ``filename`` or ``frame_idx``.
    """
    out: dict[str, _Column] = {}
    seen_layouts = set()  # filenames of one layout have the same columns: the first of each stands for all
    for name in names:
        layout = dataset.layout(name)
        if layout in seen_layouts:
            continue
        seen_layouts.add(layout)
        found = [_Column(x.path, x.dtype, x.shape, x.ragged, name) for x in layout.leaves]
        found += [_Column(p, None, (), False, name) for p in layout.nontensor]
        for col in found:
            label = column_label(col.path)
            if label in _RESERVED:
                raise ExportError(f"{name!r}: a leaf named {label!r} would collide with the {label!r} column")
            seen = out.setdefault(label, col)
            if seen.signature() != col.signature():
                out[label] = seen.joined(col)
    return dict(sorted(out.items()))


def _value_dtype(dtype: torch.dtype) -> str:
    """The Arrow value type of a tensor dtype (widened where Arrow has none)."""
    if dtype in _WIDENED or dtype == torch.complex64:
        return "float32"
    name = dtype_name(dtype)
    if name is None or name.startswith(("complex", "float8")):
        raise ExportError(f"dtype {dtype} has no Hugging Face datasets type")
    return name


def _stored_shape(col: _Column) -> tuple[int, ...]:
    """The per-frame (per-row, when ragged) shape as stored: complex64 gains a last dim of 2."""
    return (*col.shape, 2) if col.dtype == torch.complex64 else col.shape


def _tensor_feature(value: str, shape: tuple[int | None, ...], ragged: bool) -> Any:
    """The ``datasets`` feature of a tensor leaf: Value, List, ArrayND, or nested Lists.

    A dim of a known size is a fixed-size list; a dim that varies between filenames, or of size 0
    (Arrow has no fixed-size list of 0), a list of any size. A first dim of 0 (a detector that found
    nothing anywhere) is exported as a ragged leaf's rows are, so that the column's type does not
    depend on whether some frame had a row.
    """
    from datasets import Array2D, Array3D, Array4D, Array5D, List, Value

    if not ragged and shape[:1] == (0,):
        return _tensor_feature(value, shape[1:], True)

    arrays = {2: Array2D, 3: Array3D, 4: Array4D, 5: Array5D}
    dims = (None, *shape) if ragged else shape
    if 2 <= len(dims) <= _MAX_ARRAY_DIMS and all(d for d in shape):  # ArrayND: None only first
        return arrays[len(dims)](shape=dims, dtype=value)
    feature: Any = Value(value)
    for d in reversed(shape):
        feature = List(feature, length=d) if d else List(feature)
    return List(feature) if ragged else feature


def _json_feature(values: list[Any]) -> Any:
    """A JSON leaf's feature: its type when every non-null value has one (str, bool, int64, float64), else Json."""
    from datasets import Json, Value

    kinds = {type(v) for v in values if v is not None}
    if kinds == {str}:
        return Value("string")
    if kinds == {bool}:
        return Value("bool")
    if kinds == {int} and all(v is None or -(2**63) <= v < 2**63 for v in values):
        return Value("int64")
    if kinds == {float}:
        return Value("float64")
    return Json()  # mixed types (1 and 1.0 stay apart), huge ints, or no value at all


def _json_values(dataset: Dataset, names: Sequence[str], columns: dict[str, _Column]) -> dict[str, list]:
    """Every JSON leaf's values over ``names`` (reading JSON lines only), per column."""
    out: dict[str, list] = {label: [] for label, col in columns.items() if col.dtype is None or col.as_json}
    for name in names:
        layout = dataset.stored_layout(name)
        if not layout.nontensor:
            continue
        only = _json_only(layout)
        for shard, group, lo, hi in dataset.segments(name):
            _, _, json_values = read_rows(shard.f, shard.c, shard.names(group, only), only, lo, hi)
            for path, values in zip(layout.nontensor, json_values, strict=True):
                out[column_label(path)].extend(values)
    return out


def hf_features(dataset: Dataset, filenames: Sequence[str] | None = None) -> tuple[Any, dict[str, str]]:
    """The ``datasets.Features`` `to_hf` gives, and the columns whose dtype it converts.

    Returns:
        ``(features, converted)``: ``converted`` maps a column to ``"bfloat16 -> float32"`` and the like.
    """
    features, converted, _ = _features(dataset, _names(dataset, filenames))
    return features, converted


def _features(dataset: Dataset, names: list[str]) -> tuple[Any, dict[str, str], dict[str, _Column]]:
    """`hf_features` over ``names``, and the columns it was made from."""
    from datasets import Features, Value

    columns = _columns(dataset, names)
    json_values = _json_values(dataset, names, columns)
    features: dict[str, Any] = {"filename": Value("string"), "frame_idx": Value("int64")}
    converted = {}
    for label, col in columns.items():
        if col.as_json:  # nested lists of numbers beside JSON values, or lists of several depths
            features[label] = _json_feature([None])
            converted[label] = "values of several kinds -> JSON"
            continue
        if col.dtype is None:
            features[label] = _json_feature(json_values[label])
            continue
        value = _value_dtype(col.dtype)
        features[label] = _tensor_feature(value, _stored_shape(col), col.ragged)
        if value != dtype_name(col.dtype):
            extra = " (real, imag as a last dim of 2)" if col.dtype == torch.complex64 else ""
            converted[label] = f"{dtype_name(col.dtype)} -> {value}{extra}"
    return Features(features), converted, columns


def _names(dataset: Dataset, filenames: Sequence[str] | None) -> list[str]:
    if filenames is None:
        return sorted(dataset)
    missing = [n for n in filenames if n not in dataset]
    if missing:
        raise KeyError(f"not in the dataset: {missing[:5]}")
    return sorted(set(filenames))


def _numpy(t: torch.Tensor) -> Any:
    """A leaf's data as numpy, in its stored dtype (`_value_dtype`)."""
    if t.dtype in _WIDENED:
        t = t.to(torch.float32)
    elif t.dtype == torch.complex64:
        t = torch.view_as_real(t.resolve_conj())
    return t.contiguous().numpy()


def _rows_of(
    dataset: Dataset, name: str, labels: Sequence[str], kinds: dict[str, torch.dtype | None]
) -> Iterator[dict[str, Any]]:
    """One filename's frames as rows: ``filename``, ``frame_idx`` and a value (or None) per column.

    ``kinds``: each tensor column's dtype (a leaf of another dtype is converted to it), or None for
    a column of JSON values (a tensor leaf there gives nested lists).
    """
    frames = dataset[name]
    count = frames.frame_idx.numel()
    layout, tensors, json_values = flatten(frames.frames, count, name)
    cells: dict[str, Any] = {}
    for leaf, t in zip(layout.leaves, tensors, strict=True):
        label = column_label(leaf.path)
        dtype = kinds.get(label)
        values = t.values if isinstance(t, Ragged) else t
        if dtype is not None and values.dtype != dtype:
            values = values.to(dtype)
        values = values.tolist() if dtype is None else _numpy(values)
        if isinstance(t, Ragged):
            bounds = (t.offsets - t.offsets[0]).tolist()
            cells[label] = [values[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        else:
            cells[label] = values
    for path, values in zip(layout.nontensor, json_values, strict=True):
        cells[column_label(path)] = values
    for k, idx in enumerate(frames.frame_idx.tolist()):
        row = {"filename": name, "frame_idx": idx}
        for label in labels:
            column = cells.get(label)
            row[label] = None if column is None else column[k]
        yield row


def _generate(
    dataset: Dataset, names: list[str], labels: tuple[str, ...], kinds: dict[str, torch.dtype | None]
) -> Iterator[dict[str, Any]]:
    for name in names:
        yield from _rows_of(dataset, name, labels, kinds)


def _fingerprint(dataset: Dataset, names: Sequence[str], features: Any) -> str:
    """What the rows depend on: the index, each shard's size and mtime, the filenames and features."""
    h = hashlib.sha256(json.dumps(dataset.index, sort_keys=True).encode())
    for shard, entry in sorted(dataset.index["shards"].items()):
        if "sha256" in entry or "crc32" in entry:  # the checksum the index records (a shard is never rewritten)
            h.update(f"{shard}:{entry.get('sha256', entry.get('crc32'))};".encode())
        else:  # an index before version 5: the file's size and time
            st = os.stat(dataset.store.path(shard))
            h.update(f"{shard}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(json.dumps(list(names)).encode())
    h.update(json.dumps(features.to_dict(), sort_keys=True).encode())
    return h.hexdigest()[:32]


def to_hf(
    dataset: Dataset, cache_dir: str | os.PathLike | None = None, *, filenames: Sequence[str] | None = None
) -> Any:
    """The frames as a Hugging Face ``datasets.Dataset``, one row per frame (needs ``pip install tdgather[hf]``).

    Columns: ``filename`` (string), ``frame_idx`` (int64), then one per leaf, by `column_label`
    (dotted, escaped keys; a filename whose frames are plain tensors fills ``frames``); a filename without a leaf has
    None there. Features are typed: a scalar leaf is a ``Value``, a ``[n]`` leaf a
    ``List(Value, length=n)``, 2 to 5 dims an ``Array2D``..``Array5D``; a ragged leaf with rows
    ``[...]`` is an ``ArrayND`` whose first dim is None (``List(Value)`` for scalar rows). A
    JSON leaf is a ``Value`` of its type (string, bool, int64, float64) when every value has
    that one type, else ``Json()``.

    Dtypes Arrow lacks are converted, never refused, and listed in ``info.description``:
    bfloat16 and the float8 types become float32 (which holds each of their values exactly);
    complex64 becomes float32 with a last dim of 2 (real, imag). Every other dtype is kept.

    A leaf that differs between filenames is never refused either: its column takes the dtype
    both promote to (``torch.promote_types``) and a list of any size for a dim that differs; a leaf
    with another number of dims, or a tensor in one filename and JSON in another, is a ``Json()``
    column of nested lists and values (listed in ``info.description``).

    Args:
        dataset: an open `tdgather.Dataset`.
        cache_dir: where ``datasets`` writes its Arrow files; the result is memory-mapped from
            there and reused while the dataset on disk is unchanged. None: built in a temporary
            directory, loaded into memory, and the directory removed (nothing under your home).
        filenames: export only these filenames (default: all).

    Raises:
        ImportError: ``datasets`` is not installed.
        ExportError: a leaf named ``filename`` or ``frame_idx`` (it would collide with those columns).
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError("tdgather's to_hf needs Hugging Face datasets: pip install 'tdgather[hf]'") from e
    names = _names(dataset, filenames)
    features, converted, columns = _features(dataset, names)
    labels = [k for k in features if k not in _RESERVED]
    kinds = {label: None if col.as_json else col.dtype for label, col in columns.items()}
    kwargs = {
        "features": features,
        "gen_kwargs": {"dataset": dataset, "names": names, "labels": tuple(labels), "kinds": kinds},  # one list
        "fingerprint": _fingerprint(dataset, names, features),
    }
    try:
        if cache_dir is None:
            with tempfile.TemporaryDirectory(prefix="tdgather-hf-") as tmp:
                out = datasets.Dataset.from_generator(_generate, cache_dir=tmp, keep_in_memory=True, **kwargs)
        else:
            out = datasets.Dataset.from_generator(_generate, cache_dir=os.fspath(cache_dir), **kwargs)
    except datasets.exceptions.DatasetGenerationError as e:  # it wraps what our reads raised: give that back
        cause = e.__cause__ or e.__context__
        if isinstance(cause, TdgatherError):
            raise cause from None
        raise
    out.info.description = json.dumps({"tdgather": {"source": str(dataset.path), "converted": converted}})
    return out
