"""Leaves turned back into a frame's value: a tensor, a TensorDict or the user's tensorclass.

`rebuild` builds a batch of frames, `rebuild_one` one frame, from a `Layout` and the leaves that
`tdgather.core.flatten.flatten` made of it (or that were read back). A tensorclass comes back as
its class when this process defines it as it was; else as a TensorDict, with a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, is_tensorclass

from .frames import Layout
from .ragged import Ragged

__all__ = ["rebuild", "rebuild_one", "tensorclass_of"]


def rebuild(layout: Layout, count: int, tensors: list[Any], json: list[list]) -> Any:
    """Turn leaves of ``count`` frames back into a tensor, TensorDict or tensorclass.

    A ragged leaf (a `Ragged`) becomes a jagged nested tensor, a view of its values. A tree's
    batch size is ``[count, *layout.batch_dims]``. A tensorclass comes back as its class when
    that class is already imported in this process and has a field for each of the frame's
    top-level keys; else as a TensorDict, with a warning naming the class and why (tdgather
    never imports a module named by a peer or a file).
    """
    tensors = [t.to_nested() if isinstance(t, Ragged) else t for t in tensors]
    dims = list(layout.batch_dims)
    if dims and json:  # a frame's value, the same over its batch dims
        stacks = [
            NonTensorStack(*(NonTensorData(v, batch_size=dims) for v in values))
            if count
            else NonTensorData(None, batch_size=[0, *dims])
            for values in json
        ]
    else:
        stacks = [NonTensorStack.from_list(list(values)) for values in json]
    return _assemble(layout, [count], tensors, stacks)


def rebuild_one(layout: Layout, tensors: list[Any], json: list[list]) -> Any:
    """One frame's value from leaves of one frame: what ``rebuild(layout, 1, ...)[0]`` gives, built directly.

    A ragged leaf gives the frame's rows ``[N_i, ...]`` (no nested tensor is made for one frame).
    """
    tensors = [t.span()[0] if isinstance(t, Ragged) else t[0] for t in tensors]
    dims = list(layout.batch_dims)
    return _assemble(layout, [], tensors, [NonTensorData(values[0], batch_size=dims) for values in json])


def _assemble(layout: Layout, batch_size: list[int], tensors: list[Any], json: list[Any]) -> Any:
    """The value of ``layout`` from its leaves, ready made: a tensor, or a TensorDict / tensorclass."""
    if layout.kind == "tensor":
        return tensors[0]
    paths = [*(leaf.path for leaf in layout.leaves), *layout.nontensor]
    size = torch.Size([*batch_size, *layout.batch_dims])
    td = _tree(paths, [*tensors, *json], size) if len(tensors) == len(layout.leaves) else None
    if td is None:  # `set` checks each leaf, and raises where one does not fit
        td = TensorDict({}, batch_size=size)
        for leaf, t in zip(layout.leaves, tensors, strict=True):
            td.set(leaf.path, t)
        for path, value in zip(layout.nontensor, json, strict=True):
            td.set(path, value)
    if layout.cls is None:
        return td
    keys = frozenset(p[0] for p in (*(leaf.path for leaf in layout.leaves), *layout.nontensor))
    cls, why = tensorclass_of(layout.cls, keys)
    if cls is not None:
        try:
            return cls._from_tensordict(td)
        except Exception as e:  # the user's class: whatever it refuses, the frames stay readable
            why = f"it refused the frames ({type(e).__name__}: {e})"
    warnings.warn(
        f"tensorclass {layout.cls!r}: {why}; its frames are a TensorDict of its fields instead "
        "(tdgather.open(path, tensorclass=False) reads every tensorclass as a TensorDict, without this warning)",
        UserWarning,
        stacklevel=2,
    )
    return td


def _tree(paths: list[tuple[str, ...]], values: list[Any], size: torch.Size) -> TensorDict | None:
    """What ``td = TensorDict({}, batch_size=size)`` then ``td.set(path, value)`` for each gives, built directly.

    `TensorDict.set` checks each value against the batch size (about 10 us for a nested tensor, more
    than reading a small frame); here each value's leading dims are compared with ``size`` once,
    and the tree is made by ``TensorDict._new_unsafe`` (a sub-TensorDict per key prefix, of that
    batch size, as `set` makes it). The JSON values are the stacks `rebuild` and `rebuild_one`
    made (no dim names to carry over). None where that does not hold (a value that does not fit,
    paths that do not nest): the caller sets them one by one, and `set` raises as it does.
    """
    new = getattr(TensorDict, "_new_unsafe", None)
    if new is None or len(paths) != len(values):
        return None
    n = len(size)
    root: dict = {}
    for path, value in zip(paths, values, strict=True):
        shape = value.shape if isinstance(value, torch.Tensor) else getattr(value, "batch_size", None)
        if not path or shape is None or len(shape) < n or shape[:n] != size:
            return None
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if type(node) is not dict:
                return None
        if path[-1] in node:
            return None
        node[path[-1]] = value

    def build(node: dict) -> TensorDict:
        return new({k: build(v) if type(v) is dict else v for k, v in node.items()}, batch_size=size)

    try:
        return build(root)
    except (TypeError, AttributeError):  # a tensordict whose private constructor changed: `set` builds it
        return None


def tensorclass_of(name: str, keys: frozenset[str]) -> tuple[type | None, str]:
    """The tensorclass ``name`` (``"module:qualname"``) as this process defines it, if it can hold ``keys``.

    Only a module this process already imported is looked in (tdgather never imports one that a
    peer or a file names). Returns ``(cls, "")``, or ``(None, why)``: the module is not imported,
    it has no such tensorclass, or the class has no field for some of ``keys`` (a field renamed or
    removed since the frames were written; a field added comes back None, as a tensorclass has it).

    >>> tensorclass_of("tdgather.core.frames:Frames", frozenset({"frames", "frame_idx"}))
    (<class 'tdgather.core.frames.Frames'>, '')
    >>> tensorclass_of("tdgather.core.frames:Frames", frozenset({"frames", "idx"}))[1]
    "it has no field ['idx'] (its fields here: ['frame_idx', 'frames']): the class changed since the frames were made"
    """
    module_name, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module_name)  # only modules this process already imported
    if obj is None:
        return None, f"its module {module_name!r} is not imported in this process"
    for attr in qualname.split("."):
        obj = getattr(obj, attr, None) if obj is not None else None
    if not (isinstance(obj, type) and is_tensorclass(obj)):
        return None, f"module {module_name!r} has no tensorclass {qualname!r} in this process"
    why = _fields_missing(obj, keys)
    return (None, why) if why else (obj, "")


@functools.lru_cache(maxsize=256)
def _fields_missing(cls: type, keys: frozenset[str]) -> str:
    """Why ``cls`` cannot hold ``keys`` (a key that is none of its fields), or ""."""
    fields = sorted(f.name for f in dataclasses.fields(cls))
    extra = sorted(keys.difference(fields))
    if not extra:
        return ""
    return f"it has no field {extra} (its fields here: {fields}): the class changed since the frames were made"
