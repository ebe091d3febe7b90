"""A frame's value taken apart: `flatten` turns it into its `Layout` and its leaves.

The value is one frame or a batch of frames: a tensor, a nested dict / TensorDict / tensorclass
of tensors, or such a tree with plain JSON values (str, int, float, bool, None) among its leaves;
a batch may also be a list of frames. Its layout holds the structure, dtypes, per-frame shapes,
ragged leaves and the per-frame batch dims of a TensorDict whose batch size has dims past the
frames' (``[B, 3]``); its leaves are the tensors (a ragged one a `tdgather.core.ragged.Ragged`)
and the JSON values. `tdgather.core.rebuild` turns them back into a value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, is_non_tensor, is_tensorclass
from tensordict.base import TensorDictBase

from ..errors import ShapeMismatchError, UnsupportedValueError
from .dtypes import dtype_name, supported_list
from .frames import Layout, Leaf, Path, RaggedSpec
from .ragged import Ragged

__all__ = ["check_ragged_names", "flatten"]

_JSON_SCALARS = (str, int, float, bool, type(None))


def _check_tensor(t: torch.Tensor, where: str) -> None:
    problem = None
    if t.is_nested:
        problem = "a nested tensor for one frame (a batch of frames may be a jagged nested tensor)"
    elif t.layout != torch.strided:
        problem = f"layout {t.layout}"
    elif t.is_quantized:
        problem = "a quantized tensor"
    elif t.device.type == "meta":
        problem = "a meta tensor (it has no data)"
    elif dtype_name(t.dtype) is None:
        problem = f"dtype {t.dtype}"
    if problem:
        raise UnsupportedValueError(
            f"{where}: expected a dense tensor of a supported dtype ({supported_list()}), "
            f"got {problem}; convert it first, e.g. with .to_dense() or .to(torch.float32)"
        )


def _check_json(value: Any, where: str) -> None:
    if isinstance(value, torch.Tensor):  # a list of per-frame tensors under a key of a batch dict
        raise UnsupportedValueError(
            f"{where}: got a list holding tensors; a list under a key of a batch holds one JSON value per "
            "frame. Give per-frame tensors as a list of per-frame dicts ([{'boxes': t0}, {'boxes': t1}, ...]), "
            "or as one tensor: stacked, or a jagged nested tensor when their first dims differ "
            "(torch.nested.as_nested_tensor([t0, t1, ...], layout=torch.jagged))"
        )
    if not isinstance(value, _JSON_SCALARS) or (isinstance(value, float) and not math.isfinite(value)):
        raise UnsupportedValueError(
            f"{where}: expected a tensor or a plain JSON value (str, int, float, bool, None), "
            f"got {type(value).__name__} {value!r:.60}; make it a tensor or one of those"
        )


def flatten(
    value: Any, batch: int | None, where: str, ragged: RaggedSpec = frozenset(), check_names: bool = True
) -> tuple[Layout, list[Any], list[Any]]:
    """Split a frame value into its layout, tensor leaves and JSON leaves.

    Args:
        value: one frame (``batch=None``) or a batch of ``batch`` frames: a tensor, dict,
            TensorDict or tensorclass with that leading dim, or a list of ``batch`` frames
            (or a ``LazyStackedTensorDict`` of them). A jagged nested tensor in a batch is a
            ragged leaf, and so is, in a list, a tensor whose first dim differs between frames.
        batch: the batch size, or None for a single frame.
        where: what to name in error messages (a filename, a key).
        ragged: leaves to make ragged even where every frame has the same first dim (dotted
            paths; True: every tensor leaf of at least one dim).
        check_names: refuse a name in ``ragged`` that matches no tensor leaf of ``value``
            (`check_ragged_names`; off where the caller checks the names over many values).

    Returns:
        ``(layout, tensors, json)``: a ragged leaf's tensor is a `tdgather.core.ragged.Ragged`; for a
        batch, each JSON leaf is a list of ``batch`` values.

    >>> lay, t, j = flatten({"m": torch.zeros(2, 3), "s": ["a", "b"]}, 2, "x")
    >>> lay.describe(), j
    ('{m: float32[3], s: json}', [['a', 'b']])
    >>> flatten([torch.zeros(2, 4), torch.zeros(0, 4)], 2, "x")[0].describe()
    'float32[*, 4]'
    """
    out = _flatten(value, batch, where, ragged)
    if check_names and (batch is None or batch):  # an empty batch has no leaves to match
        check_ragged_names(ragged, {".".join(leaf.path) for leaf in out[0].leaves}, where)
    return out


def check_ragged_names(ragged: RaggedSpec, known: set[str], where: str) -> None:
    """Refuse names in ``ragged`` that are none of the dotted tensor leaves ``known`` (a typo, most often)."""
    unknown = sorted(ragged - known) if isinstance(ragged, frozenset) else []
    if unknown:
        raise ValueError(
            f"{where}: ragged={sorted(ragged)} names {unknown}, which is not a tensor leaf here; the tensor "
            f"leaves are {sorted(known) or 'none'} (dotted keys; for a plain tensor pass ragged=True)"
        )


def _flatten(value: Any, batch: int | None, where: str, ragged: RaggedSpec) -> tuple[Layout, list[Any], list[Any]]:
    if batch is not None and isinstance(value, LazyStackedTensorDict):
        value = list(value.unbind(0))
    if batch is not None and isinstance(value, tuple):  # a model's several outputs, far more often than frames
        raise UnsupportedValueError(
            f"{where}: got a tuple of {len(value)}; a batch is a tensor [B, ...], a dict (or TensorDict) of them, "
            "or a list of B per-frame values. For a model with several outputs, return a dict that names them "
            "({'depth': y, 'seg': z}); for per-frame values, a list"
        )
    if batch is not None and isinstance(value, list):
        return _flatten_list(value, batch, where, ragged)
    if isinstance(value, torch.Tensor | Ragged):
        leaf, t = _leaf(value, (), batch, where, ragged)
        return Layout("tensor", None, (leaf,)), [t], []
    cls = None
    if is_tensorclass(value):
        cls = f"{type(value).__module__}:{type(value).__qualname__}"
        value = value._tensordict
    if not isinstance(value, Mapping | TensorDictBase):
        raise UnsupportedValueError(
            f"{where}: expected a tensor, or a dict / TensorDict / tensorclass of tensors"
            f"{', or a list of frames' if batch is not None else ''}, got {type(value).__name__}"
            f"{_wrap_hint(value, batch)}"
        )
    dims: tuple[int, ...] = ()  # a frame's own batch dims: a batch's past the first ([B, 3] -> (3,))
    if isinstance(value, TensorDictBase):
        dims = tuple(value.batch_size[1:] if batch is not None else value.batch_size)
    found: list[tuple[Path, Any, bool]] = []
    _walk(value, (), batch, where, found, dims)
    leaves, tensors, json_paths, json_values = [], [], [], []
    for path, v, is_tensor in found:
        if is_tensor:
            leaf, t = _leaf(v, path, batch, f"{where} key {'.'.join(path)!r}", ragged)
            leaves.append(leaf)
            tensors.append(t)
        else:
            json_paths.append(path)
            json_values.append(v)
    return Layout("tree", cls, tuple(leaves), tuple(json_paths), dims), tensors, json_values


def _wrap_hint(value: Any, batch: int | None) -> str:
    """For a bare str, number, bool or None given as a frame (or a batch): the value, and the dict to wrap it in."""
    if not isinstance(value, _JSON_SCALARS):
        return ""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    kind = "None" if value is None else f"{'an' if type(value) is int else 'a'} {type(value).__name__}"
    key = "caption" if isinstance(value, str) else "flag" if isinstance(value, bool) else "score" if number else "note"
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    tensor = f" (a number may also be a tensor: torch.tensor({shown}))" if number else ""
    if batch is None:
        return f" {shown}; {kind} is stored as a JSON leaf of a dict: wrap it, e.g. {{{key!r}: {shown}}}{tensor}"
    return (
        f" {shown}; {kind} is stored as a JSON leaf of a dict, one value per frame: give the batch as "
        f"{{{key!r}: [{shown}, ...]}} (a list of {batch}), or a list of per-frame dicts [{{{key!r}: {shown}}}, ...]"
    )


def _named(path: Path, ragged: RaggedSpec) -> bool:
    return ragged is True or (bool(ragged) and ".".join(path) in ragged)


def _leaf(v: Any, path: Path, batch: int | None, where: str, ragged: RaggedSpec) -> tuple[Leaf, Any]:
    """One tensor leaf: its `Leaf` and what is stored (the tensor, or a `Ragged`)."""
    if batch is not None and isinstance(v, torch.Tensor) and (hasattr(v, "_ragged_idx") or v.is_nested):
        v = Ragged.from_nested(v, where)
    if isinstance(v, Ragged):
        _check_tensor(v.values, where)
        if len(v) != batch:
            raise ValueError(f"{where}: expected {batch} frames, got a ragged leaf of {len(v)}")
        return Leaf(path, v.dtype, tuple(v.values.shape[1:]), True), v
    _check_tensor(v, where)
    shape = _frame_shape(v, batch, where)
    if batch is None or not _named(path, ragged):
        return Leaf(path, v.dtype, shape), v
    if not shape:
        if ragged is True:
            return Leaf(path, v.dtype, shape), v  # one value per frame: nothing to be ragged
        raise ValueError(f"{where}: named ragged, but it holds one value per frame (shape {list(v.shape)})")
    n = shape[0]  # every frame has n rows: a view, offsets 0, n, 2n, ...
    return Leaf(path, v.dtype, shape[1:], True), Ragged(v.reshape(batch * n, *shape[1:]), torch.arange(batch + 1) * n)


def _flatten_list(items: list | tuple, batch: int, where: str, ragged: RaggedSpec) -> tuple[Layout, list, list]:
    """A list of ``batch`` frames as one batch: leaves stacked, or joined as `Ragged` where they vary."""
    if len(items) != batch:
        raise ValueError(f"{where}: expected a list of {batch} frames (one per filename), got {len(items)}")
    if not items:
        return Layout("tree", None, ()), [], []
    per = [flatten(item, None, f"{where}[{k}]" if batch > 1 else where) for k, item in enumerate(items)]
    first = per[0][0]

    def skeleton(lay: Layout) -> tuple:
        rows = tuple((x.path, x.dtype, len(x.shape), x.shape[1:]) for x in lay.leaves)
        return lay.kind, lay.cls, rows, lay.nontensor

    def refuse(k: int) -> ShapeMismatchError:
        error = ShapeMismatchError(
            f"{where}: frame {k} of the list has {per[k][0].describe()} but frame 0 has {first.describe()}; the frames "
            "of a filename must share their structure, dtypes and batch dims (only a leaf's first dim may differ)"
        )
        error.frame = k  # type: ignore[attr-defined]  # which frame: a caller names its filename
        return error

    for k, (lay, _, _) in enumerate(per):
        if skeleton(lay) != skeleton(first):
            raise refuse(k)
    leaves, tensors = [], []
    for j, leaf in enumerate(first.leaves):
        ts = [p[1][j] for p in per]
        if not leaf.shape and ragged is not True and _named(leaf.path, ragged):
            raise ValueError(f"{where}: {'.'.join(leaf.path)!r} is named ragged, but it holds one value per frame")
        if leaf.shape and (_named(leaf.path, ragged) or any(t.shape[0] != leaf.shape[0] for t in ts)):
            leaves.append(Leaf(leaf.path, leaf.dtype, leaf.shape[1:], True))
            tensors.append(Ragged.from_list(ts))
        else:
            leaves.append(leaf)
            tensors.append(torch.stack([t.detach() for t in ts]))
    json = [[p[2][j] for p in per] for j in range(len(first.nontensor))]
    layout = Layout(first.kind, first.cls, tuple(leaves), first.nontensor, first.batch_dims)
    if layout.batch_dims:  # kept only where every frame has them (a ragged leaf has dropped them)
        for k, (lay, _, _) in enumerate(per):
            if lay.batch_dims != first.batch_dims:
                raise refuse(k)
    return layout, tensors, json


def _frame_shape(t: torch.Tensor, batch: int | None, where: str) -> tuple[int, ...]:
    if batch is None:
        return tuple(t.shape)
    if t.dim() == 0 or t.shape[0] != batch:
        raise ValueError(f"{where}: expected a leading batch dimension of {batch}, got shape {list(t.shape)}")
    return tuple(t.shape[1:])


def _walk(node: Any, path: Path, batch: int | None, where: str, out: list, dims: tuple[int, ...] = ()) -> None:
    keys = list(node.keys())
    for key in keys:  # before the sort, which cannot order an int among str
        if not isinstance(key, str):
            raise UnsupportedValueError(f"{where}: expected str keys, got {type(key).__name__} {key!r}")
    for key in sorted(keys) if isinstance(node, Mapping) else sorted(keys, key=str):
        sub = (*path, key)
        label = f"{where} key {'.'.join(sub)!r}"
        v = node.get(key) if isinstance(node, TensorDictBase) else node[key]
        if isinstance(node, TensorDictBase) and is_non_tensor(v):
            v = _non_tensor(v, batch, dims, label)
        if isinstance(v, torch.Tensor | Ragged):
            out.append((sub, v, True))
        elif isinstance(v, Mapping | TensorDictBase) or is_tensorclass(v):
            _walk(v._tensordict if is_tensorclass(v) else v, sub, batch, where, out, dims)
        else:
            values = v if batch is not None else [v]
            if batch is not None and (not isinstance(v, list | tuple) or len(v) != batch):
                raise UnsupportedValueError(f"{label}: expected a tensor or a list of {batch} JSON values")
            for item in values:
                _check_json(item, label)
            out.append((sub, list(v) if batch is not None else v, False))


def _non_tensor(v: Any, batch: int | None, dims: tuple[int, ...], label: str) -> Any:
    """A TensorDict's non-tensor entry as JSON leaves take it: one value a frame (a list of them for a batch).

    Over a frame's own batch dims (``dims``) the value must be one, as a `NonTensorData` holds it.
    """
    if not dims:
        return v.tolist() if batch is not None else v.data
    if batch is None:
        return v.data if isinstance(v, NonTensorData) else _one_value(v.tolist(), len(dims), dims, label)
    return [_one_value(item, len(dims), dims, label) for item in v.tolist()]


def _one_value(nested: Any, depth: int, dims: tuple[int, ...], label: str) -> Any:
    """The one value a frame's nested list (``depth`` levels of batch dims) holds everywhere."""
    values = [nested]
    for _ in range(depth):
        values = [x for item in values for x in (item if isinstance(item, list) else [item])]
    first = values[0] if values else None
    for x in values:
        if type(x) is not type(first) or x != first:
            raise UnsupportedValueError(
                f"{label}: a JSON leaf holds one value per frame, the same over the frame's batch dims "
                f"{list(dims)}; got {first!r:.40} and {x!r:.40} in one frame. Make it a tensor, or give one "
                "value per frame (a NonTensorData)"
            )
    return first
