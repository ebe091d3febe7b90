"""Variable-length leaves found, not declared: a leaf whose first dim varies becomes ragged.

Two layouts of one filename *fit* when they differ only in the first dim of some leaves, or in
whether a leaf is ragged (`varying`): those leaves are then made ragged in both (`promote`), and
the frames are one layout again. This holds wherever the two meet: in one rank's store, at rank
dst across ranks (`unify`, before placing), against frames written earlier, and on read.

A leaf name has one type across a dataset, decided by every frame of it (`ragged_names`): a leaf
ragged anywhere, or whose first dim differs between any two frames (of one filename or of two,
whatever their other dims), is ragged in every layout that has it. Leaves are named by their path
(a tuple of keys), so ``{"a.b": x}`` and ``{"a": {"b": y}}`` are two leaves. A fixed column
converts to a ragged one without a copy (`promote_columns`, `promote_part`): its values are the
same bytes, and each frame's row count is its first dim. A dim other than the first, a dtype or
the set of keys never fits.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .frames import Layout, Leaf
from .part import Part
from .ragged import Ragged

__all__ = [
    "SAME_LAYOUT",
    "common_layout",
    "promote",
    "promote_columns",
    "promote_part",
    "ragged_hint",
    "ragged_names",
    "schema",
    "type_of",
    "unify",
    "varying",
]


# what a filename's frames must share, as error messages say it
SAME_LAYOUT = (
    "every frame of a filename must have the same keys and dtypes, and the same dims after the first "
    "(a leaf whose first dim changes is made ragged)"
)


Path = tuple[str, ...]  # a leaf's keys; () for a plain tensor


def _row(x: Leaf) -> tuple | None:
    """A leaf's dtype and the shape of one row, for a leaf that has rows (ragged, or a first dim)."""
    return (x.dtype, x.shape) if x.ragged else (x.dtype, x.shape[1:]) if x.shape else None


def varying(a: Layout, b: Layout) -> frozenset[Path] | None:
    """The leaves (paths) that make ``a`` and ``b`` differ, when only first dims or raggedness do; else None.

    >>> fixed = Layout("tree", None, (Leaf(("boxes",), torch.float32, (3, 4)),))
    >>> sorted(varying(fixed, Layout("tree", None, (Leaf(("boxes",), torch.float32, (5, 4)),))))
    [('boxes',)]
    >>> varying(fixed, Layout("tree", None, (Leaf(("boxes",), torch.float32, (3, 5)),))) is None
    True
    """
    if a == b:
        return frozenset()
    if (a.kind, a.cls, a.nontensor) != (b.kind, b.cls, b.nontensor) or [x.path for x in a.leaves] != [
        y.path for y in b.leaves
    ]:
        return None
    out = set()
    for x, y in zip(a.leaves, b.leaves, strict=True):
        if x != y:
            if _row(x) is None or _row(x) != _row(y):
                return None
            out.add(x.path)
    if not out:  # equal leaves, other batch dims ([B, 3] and [B] TensorDicts of [3, ...] leaves): two types
        return None
    return frozenset(out)


def ragged_names(layouts: Iterable[Layout]) -> frozenset[Path]:
    """The leaves (paths) that frames of these layouts hold as ragged: one type per leaf name.

    A leaf is ragged when it is ragged in any layout, and when its first dim differs between two
    layouts in which it has the same dtype and number of dims, whatever its other dims: two
    filenames of one frame each, two batches, masks ``[n, 1, H, W]`` of images of two sizes. A leaf
    of one value per frame (``[]``) has no first dim; one whose first dim is equal everywhere (0
    included: a detector that found nothing) keeps its layouts, as does a leaf of ``[2]`` in one
    filename and ``[4, 2]`` in another (two kinds of value, not rows of one).

    >>> tokens = [Layout("tree", None, (Leaf(("tokens",), torch.int64, (n,)),)) for n in (7, 5)]
    >>> sorted(ragged_names(tokens)), sorted(ragged_names(tokens[:1]))
    ([('tokens',)], [])
    """
    ragged: set[Path] = set()
    firsts: dict[tuple[Path, torch.dtype, int], set[int]] = {}
    for layout in layouts:
        for x in layout.leaves:
            if x.ragged:
                ragged.add(x.path)
            elif x.shape:
                firsts.setdefault((x.path, x.dtype, len(x.shape)), set()).add(x.shape[0])
    ragged.update(path for (path, _, _), dims in firsts.items() if len(dims) > 1)
    return frozenset(ragged)


def schema(layouts: Iterable[Layout], fixed: bool = False) -> tuple[Layout, ...]:
    """The frame types of a dataset whose groups have ``layouts``: each promoted by `ragged_names`, distinct.

    ``fixed`` (frames declared ``ragged=False``): only leaves ragged somewhere are made ragged, so
    filenames whose first dims differ keep types of their own. Sorted by description, so that the
    same groups always give the same schema.

    >>> tokens = [Layout("tree", None, (Leaf(("tokens",), torch.int64, (n,)),)) for n in (7, 5)]
    >>> [t.describe() for t in schema(tokens)], [t.describe() for t in schema(tokens, fixed=True)]
    (['{tokens: int64[*]}'], ['{tokens: int64[5]}', '{tokens: int64[7]}'])
    """
    layouts = list(dict.fromkeys(layouts))
    if fixed:
        names = frozenset(x.path for layout in layouts for x in layout.leaves if x.ragged)
    else:
        names = ragged_names(layouts)
    return tuple(sorted(dict.fromkeys(promote(x, names) for x in layouts), key=lambda t: (t.describe(), repr(t))))


def type_of(stored: Layout, types: Iterable[Layout]) -> list[Layout]:
    """The types of ``types`` that frames stored as ``stored`` read as: one, in a schema `schema` made.

    A type fits when it is ``stored`` with some leaves made ragged (`promote`).

    >>> fixed = Layout("tree", None, (Leaf(("tokens",), torch.int64, (7,)),))
    >>> [t.describe() for t in type_of(fixed, schema([fixed, promote(fixed, {("tokens",)})]))]
    ['{tokens: int64[*]}']
    """
    return [t for t in types if promote(stored, {x.path for x in t.leaves if x.ragged}) == t]


def common_layout(a: Layout, b: Layout) -> Layout | None:
    """The one layout both ``a`` and ``b`` promote to, or None when they do not fit."""
    names = varying(a, b)
    return None if names is None else promote(a, names)


def promote(layout: Layout, ragged: Collection[Path]) -> Layout:
    """``layout`` with its leaves whose paths are in ``ragged`` made ragged (those with a first dim; others stay).

    >>> lay = Layout("tree", None, (Leaf(("boxes",), torch.float32, (7, 4)), Leaf(("score",), torch.float32, ())))
    >>> promote(lay, {("boxes",), ("score",)}).describe()
    '{boxes: float32[*, 4], score: float32[]}'
    """
    if not ragged:
        return layout
    leaves = tuple(
        replace(x, shape=x.shape[1:], ragged=True) if not x.ragged and x.shape and x.path in ragged else x
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
            out[j] = Ragged.from_lengths(_values(out[j], x), _rows(out[j].shape[0], x.shape[0]))
    return out


def promote_part(part: Part, layout: Layout) -> Part:
    """``part`` as ``layout`` (its promotion) holds it: the same bytes, with each frame's rows counted.

    A promoted leaf's chunks ``[B, n, *row]`` become its values ``[B * n, *row]`` (views), and its
    lengths n per frame. ``part`` itself is left as it was.
    """
    if layout == part.layout:
        return part
    lengths = list(part.lengths) or [None] * len(layout.leaves)
    chunks = [list(c) for c in part.chunks]
    for j, (x, y) in enumerate(zip(part.layout.leaves, layout.leaves, strict=True)):
        if y.ragged and not x.ragged:
            lengths[j] = _rows(part.num_frames, x.shape[0])
            for c in chunks:
                c[j] = _values(c[j], x)
    return Part(part.rank, layout, part.files, part.file_ids, part.frame_idx, part.json, chunks, lengths, part.row_rank)


def unify(parts: list[Part]) -> list[Part]:
    """``parts`` with every leaf made ragged that `ragged_names` finds in their layouts, in every part.

    A leaf ragged in any part, or whose first dim differs between two parts (of one filename or of
    two), is made ragged in each. Layouts that do not fit are left
    as they are, for `tdgather.core.plan.place` to report.
    """
    names = ragged_names({p.layout for p in parts if p.num_frames})
    if not names:
        return parts
    return [promote_part(p, promote(p.layout, names)) for p in parts]


def ragged_hint(a: Layout, b: Layout) -> str:
    """For two layouts of one filename that fit (`varying`): why they were not made one. "" when they do not fit.

    Only frames declared fixed (``ragged=False``) are refused for a first dim that changes.
    """
    names = varying(a, b)
    if not names:
        return ""
    dotted = sorted(".".join(path) for path in names)
    return (
        f"; only the first dim of {dotted} changes: that is allowed (those leaves become ragged) unless "
        "the frames are declared fixed with ragged=False, as these were"
    )


def _values(t: torch.Tensor, leaf: Leaf) -> torch.Tensor:
    """A fixed leaf's column ``[B, n, *row]`` as ragged values ``[B * n, *row]`` (a view where contiguous)."""
    return t.reshape(t.shape[0] * leaf.shape[0], *leaf.shape[1:])


def _rows(frames: int, n: int) -> torch.Tensor:
    return torch.full((frames,), n, dtype=torch.int64)
