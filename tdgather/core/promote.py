"""A leaf name has one type across a dataset: a fixed leaf made ragged where the name is ragged elsewhere.

Once a leaf is ragged in any filename, it is ragged in every layout that has it (`promote`), so a
reader gets one type for a leaf name across a dataset. A fixed column converts to a ragged one
without a copy (`promote_columns`): its values are the same bytes, and each frame's row count is
its first dim.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

import torch

from .frames import Layout, Leaf
from .ragged import Ragged

__all__ = ["dotted", "promote", "promote_columns"]


def dotted(leaf: Leaf) -> str:
    """A leaf's name as ``ragged=`` takes it: its dotted path (``""`` for a plain tensor)."""
    return ".".join(leaf.path)


def promote(layout: Layout, ragged: Collection[str]) -> Layout:
    """``layout`` with its leaves named in ``ragged`` made ragged (those with a first dim; others stay).

    >>> lay = Layout("tree", None, (Leaf(("boxes",), torch.float32, (7, 4)), Leaf(("score",), torch.float32, ())))
    >>> promote(lay, {"boxes", "score"}).describe()
    '{boxes: float32[*, 4], score: float32[]}'
    """
    if not ragged:
        return layout
    leaves = tuple(
        replace(x, shape=x.shape[1:], ragged=True) if not x.ragged and x.shape and dotted(x) in ragged else x
        for x in layout.leaves
    )
    return layout if leaves == layout.leaves else replace(layout, leaves=leaves)


def promote_columns(old: Layout, new: Layout, columns: Sequence[Any]) -> list[Any]:
    """Columns of ``old`` as ``new`` (its promotion) holds them: a fixed leaf made ragged becomes a `Ragged`.

    No copy: a fixed column ``[N, n, *row]`` is the values ``[N * n, *row]``, n rows per frame.
    """
    out = list(columns)
    for j, (x, y) in enumerate(zip(old.leaves, new.leaves, strict=True)):
        if y.ragged and not x.ragged:
            t = out[j]
            n = t.shape[1] if t.dim() > 1 else 0
            values = t.reshape(t.shape[0] * n, *t.shape[2:])
            out[j] = Ragged.from_lengths(values, torch.full((t.shape[0],), n, dtype=torch.int64))
    return out
