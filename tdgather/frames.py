"""The data model shared by every stage: `Frames` and `Layout`.

A frame's value is a tensor, a nested dict / TensorDict / tensorclass of
tensors, or such a tree with plain JSON values (str, int, float, bool, None)
among its leaves. `flatten` turns a value into a `Layout` (the structure,
dtypes and per-frame shapes) plus its tensor and JSON leaves; `rebuild` turns
leaves back into a tensor, a TensorDict or the user's tensorclass.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, is_non_tensor, is_tensorclass, tensorclass
from tensordict.base import TensorDictBase

from ._dtypes import dtype_from_name, dtype_name, supported_list
from .errors import UnsupportedValueError

__all__ = [
    "Frames",
    "Layout",
    "Leaf",
    "flatten",
    "gather_rows",
    "rebuild",
    "row_view",
    "run_start",
    "scatter_rows",
]

Path = tuple[str, ...]
_JSON_SCALARS = (str, int, float, bool, type(None))


@tensorclass
class Frames:
    """The frames of one filename, ordered by ``frame_idx``.

    Attributes:
        frame_idx: LongTensor ``[T]``, strictly increasing.
        frames: ``Tensor[T, ...]``, or a TensorDict / tensorclass with batch size ``[T]``.
    """

    frame_idx: torch.Tensor
    frames: Any


@dataclass(frozen=True)
class Leaf:
    """One tensor leaf of a frame: where it sits, its dtype and its per-frame shape."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """The structure of one frame; frames of one filename must share it.

    Attributes:
        kind: ``"tensor"`` for a plain tensor, ``"tree"`` for a dict, TensorDict or tensorclass.
        cls: ``"module:qualname"`` of a tensorclass, else None.
        leaves: the tensor leaves, sorted by path.
        nontensor: the paths of JSON leaves, sorted.
    """

    kind: str
    cls: str | None
    leaves: tuple[Leaf, ...]
    nontensor: tuple[Path, ...] = ()

    def describe(self) -> str:
        """Return a short human description, as used in error messages.

        >>> Layout("tensor", None, (Leaf((), torch.float32, (3, 4)),)).describe()
        'float32[3, 4]'
        """
        if self.kind == "tensor":
            leaf = self.leaves[0]
            return f"{dtype_name(leaf.dtype)}{list(leaf.shape)}"
        parts = [f"{'.'.join(leaf.path)}: {dtype_name(leaf.dtype)}{list(leaf.shape)}" for leaf in self.leaves]
        parts += [f"{'.'.join(p)}: json" for p in self.nontensor]
        name = self.cls.rsplit(":", 1)[-1] if self.cls else ""
        return f"{name}{{{', '.join(parts)}}}"

    def to_json(self) -> dict:
        """The JSON form used in wire headers, shard metadata and the index."""
        return {
            "kind": self.kind,
            "cls": self.cls,
            "leaves": [
                {"path": list(x.path), "dtype": dtype_name(x.dtype), "shape": list(x.shape)} for x in self.leaves
            ],
            "json": [list(p) for p in self.nontensor],
        }

    @staticmethod
    def from_json(obj: dict) -> Layout:
        """Inverse of `to_json` for trusted input (the receive path validates first).

        >>> lay = Layout("tensor", None, (Leaf((), torch.bool, (2,)),))
        >>> Layout.from_json(lay.to_json()) == lay
        True
        """
        leaves = tuple(Leaf(tuple(x["path"]), dtype_from_name(x["dtype"]), tuple(x["shape"])) for x in obj["leaves"])
        return Layout(obj["kind"], obj["cls"], leaves, tuple(tuple(p) for p in obj["json"]))

    @property
    def frame_nbytes(self) -> int:
        """Bytes of tensor data in one frame."""
        return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in self.leaves)


def _check_tensor(t: torch.Tensor, where: str) -> None:
    problem = None
    if t.layout != torch.strided:
        problem = f"layout {t.layout}"
    elif t.is_nested:
        problem = "a nested tensor"
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
    if not isinstance(value, _JSON_SCALARS) or (isinstance(value, float) and not math.isfinite(value)):
        raise UnsupportedValueError(
            f"{where}: expected a tensor or a plain JSON value (str, int, float, bool, None), "
            f"got {type(value).__name__} {value!r:.60}; make it a tensor or one of those"
        )


def flatten(value: Any, batch: int | None, where: str) -> tuple[Layout, list[torch.Tensor], list[Any]]:
    """Split a frame value into its layout, tensor leaves and JSON leaves.

    Args:
        value: one frame (``batch=None``) or a batch of ``batch`` frames (leading dim).
        batch: the batch size, or None for a single frame.
        where: what to name in error messages (a filename, a key).

    Returns:
        ``(layout, tensors, json)``: for a batch, each JSON leaf is a list of ``batch`` values.

    >>> lay, t, j = flatten({"m": torch.zeros(2, 3), "s": ["a", "b"]}, 2, "x")
    >>> lay.describe(), j
    ('{m: float32[3], s: json}', [['a', 'b']])
    """
    if isinstance(value, torch.Tensor):
        _check_tensor(value, where)
        return Layout("tensor", None, (Leaf((), value.dtype, _frame_shape(value, batch, where)),)), [value], []
    cls = None
    if is_tensorclass(value):
        cls = f"{type(value).__module__}:{type(value).__qualname__}"
        value = value._tensordict
    if not isinstance(value, Mapping | TensorDictBase):
        raise UnsupportedValueError(
            f"{where}: expected a tensor, or a dict / TensorDict / tensorclass of tensors, got {type(value).__name__}"
        )
    found: list[tuple[Path, Any, bool]] = []
    _walk(value, (), batch, where, found)
    leaves, tensors, json_paths, json_values = [], [], [], []
    for path, v, is_tensor in found:
        if is_tensor:
            leaves.append(Leaf(path, v.dtype, _frame_shape(v, batch, f"{where} key {'.'.join(path)!r}")))
            tensors.append(v)
        else:
            json_paths.append(path)
            json_values.append(v)
    return Layout("tree", cls, tuple(leaves), tuple(json_paths)), tensors, json_values


def _frame_shape(t: torch.Tensor, batch: int | None, where: str) -> tuple[int, ...]:
    if batch is None:
        return tuple(t.shape)
    if t.dim() == 0 or t.shape[0] != batch:
        raise ValueError(f"{where}: expected a leading batch dimension of {batch}, got shape {list(t.shape)}")
    return tuple(t.shape[1:])


def _walk(node: Any, path: Path, batch: int | None, where: str, out: list) -> None:
    keys = list(node.keys())
    for key in sorted(keys) if isinstance(node, Mapping) else sorted(keys, key=str):
        if not isinstance(key, str):
            raise UnsupportedValueError(f"{where}: expected str keys, got {type(key).__name__} {key!r}")
        sub = (*path, key)
        label = f"{where} key {'.'.join(sub)!r}"
        v = node.get(key) if isinstance(node, TensorDictBase) else node[key]
        if isinstance(node, TensorDictBase) and is_non_tensor(v):
            v = v.tolist() if batch is not None else v.data
        if isinstance(v, torch.Tensor):
            _check_tensor(v, label)
            out.append((sub, v, True))
        elif isinstance(v, Mapping | TensorDictBase) or is_tensorclass(v):
            _walk(v._tensordict if is_tensorclass(v) else v, sub, batch, where, out)
        else:
            values = v if batch is not None else [v]
            if batch is not None and (not isinstance(v, list | tuple) or len(v) != batch):
                raise UnsupportedValueError(f"{label}: expected a tensor or a list of {batch} JSON values")
            for item in values:
                _check_json(item, label)
            out.append((sub, list(v) if batch is not None else v, False))


def rebuild(layout: Layout, count: int, tensors: list[torch.Tensor], json: list[list]) -> Any:
    """Turn leaves of ``count`` frames back into a tensor, TensorDict or tensorclass.

    A tensorclass comes back as its class when that class is already imported in
    this process; tdgather never imports a module named by a peer.
    """
    if layout.kind == "tensor":
        return tensors[0]
    td = TensorDict({}, batch_size=[count])
    for leaf, t in zip(layout.leaves, tensors, strict=True):
        td.set(leaf.path, t)
    for path, values in zip(layout.nontensor, json, strict=True):
        td.set(path, NonTensorStack.from_list(list(values)))
    cls = _loaded_tensorclass(layout.cls)
    return cls._from_tensordict(td) if cls is not None else td


def _loaded_tensorclass(name: str | None) -> type | None:
    if not name or ":" not in name:
        return None
    module_name, qualname = name.split(":", 1)
    obj: Any = sys.modules.get(module_name)  # only modules this process already imported
    for attr in qualname.split("."):
        obj = getattr(obj, attr, None) if obj is not None else None
    return obj if isinstance(obj, type) and is_tensorclass(obj) else None


_WIDTHS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _row_width(t: torch.Tensor) -> int:
    nbytes = math.prod(t.shape[1:]) * t.dtype.itemsize
    offset = t.storage_offset() * t.dtype.itemsize
    return next(w for w in _WIDTHS if nbytes % w == 0 and offset % w == 0 and (nbytes or w == 1))


def row_view(t: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """View ``[B, ...]`` as integer rows ``[B, k]``, bit-exact, as wide as the frame size allows.

    Copying, scattering and comparing whole rows through the widest integer view is
    dtype-agnostic (bool, float8, NaN bits) and fast. Only non-contiguous input is copied.

    >>> row_view(torch.ones(2, 3, dtype=torch.float16)).dtype, row_view(torch.ones(2, 2)).shape
    (torch.int16, torch.Size([2, 1]))
    """
    t = t.contiguous()
    width = width or _row_width(t)
    nbytes = math.prod(t.shape[1:]) * t.dtype.itemsize
    return t.view(-1).view(torch.uint8).view(_WIDTHS[width]).view(t.shape[0], nbytes // width)


def gather_rows(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """``dst[i] = src[index[i]]`` for whole rows, bit-exact, in one kernel."""
    src = src.contiguous()
    width = min(_row_width(dst), _row_width(src))
    torch.index_select(row_view(src, width), 0, index, out=row_view(dst, width))


def scatter_rows(dst: torch.Tensor, target: int | torch.Tensor, src: torch.Tensor) -> None:
    """Copy the rows of ``src`` into ``dst``: from row ``target`` on, or to the rows it lists."""
    src = src.contiguous()
    if isinstance(target, int):
        dst = dst[target : target + src.shape[0]]
    width = min(_row_width(dst), _row_width(src))
    if isinstance(target, int):
        row_view(dst, width).copy_(row_view(src, width))
    else:
        row_view(dst, width).index_copy_(0, target, row_view(src, width))


def run_start(positions: torch.Tensor) -> int | None:
    """The first position when ``positions`` is one increasing run (a plain copy will do), else None.

    >>> run_start(torch.tensor([4, 5, 6])), run_start(torch.tensor([4, 6]))
    (4, None)
    """
    if positions.numel() == 0:
        return 0
    first = int(positions[0])
    last = int(positions[-1])
    if last - first + 1 == positions.numel() and bool((positions.diff() == 1).all()):
        return first
    return None
