"""Reading rows of a shard: one segment, a span of rows, a group's offsets and JSON lines.

The reader, the sink (copies compared with the disk), recovery and the coordinator all read
shards through here, from a `tdgather.storage.store.Store`. Only shard names are opened (`open_shard`);
offsets are checked (non-decreasing, inside their blob) before anything they point at is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.frames import Layout
from ..core.promote import common_layout, promote_columns
from ..core.ragged import Ragged, element_index
from ..format.check import Check, check_group, check_layout, check_segment, json_scalar, names_in, shard_groups
from ..format.codec import SafetensorsFile
from ..format.names import SHARD_NAME, GroupNames, group_names
from .store import Store

__all__ = [
    "OpenShard",
    "cat_columns",
    "nested",
    "offsets_of_rows",
    "open_shard",
    "read_picked",
    "read_rows",
    "read_segment",
    "read_span",
]


@dataclass
class OpenShard:
    """A shard a `Dataset` opened and checked: its `tdgather.format.codec.SafetensorsFile`, and tensor names per group.

    A local file is mapped as it was when opened: it keeps reading those bytes after the path is
    replaced or removed.

    Attributes:
        f: the `tdgather.format.codec.SafetensorsFile`.
        c: the shard file's `Check` (errors name the file).
        version: the tensor names' version (`tdgather.format.names`), from its ``__metadata__``.
        shard: the shard's name, as the index lists it.
    """

    f: Any
    c: Check
    version: int
    shard: str = ""  # its name in the index
    _names: dict = field(default_factory=dict, init=False, repr=False)

    def names(self, group: str, layout: Layout) -> GroupNames:
        """The tensor names of ``group`` read with ``layout`` (cached)."""
        got = self._names.get((group, layout))
        if got is None:
            got = self._names[group, layout] = group_names(group, layout, self.version)
        return got


def _nested_constructor() -> Any:
    """The jagged nested tensor class, where calling it builds what `torch.nested.nested_tensor_from_jagged` does.

    ``torch.nested.nested_tensor_from_jagged`` dispatches a view op through Python (about 45 us, more
    than reading a small frame); the class it ends in takes the same arguments directly (about
    12 us). Private to torch: checked once against the public call, and not used where it differs.
    """
    try:
        from torch.nested._internal.nested_tensor import NestedTensor

        values, offsets = torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 1, 3])
        got, want = NestedTensor(values, offsets), torch.nested.nested_tensor_from_jagged(values, offsets)
        same = type(got) is type(want) and got._ragged_idx == want._ragged_idx and got.dim() == want.dim()
        same = same and all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind(), strict=True))
        return NestedTensor if same else None
    except Exception:  # noqa: BLE001  # another torch: the public call
        return None


_NESTED = _nested_constructor()


def nested(column: Ragged) -> torch.Tensor:
    """A `Ragged` read from a shard as a jagged nested tensor ``[T, j, ...]``: what `Ragged.to_nested` gives, sooner."""
    values, offsets = column.values, column.offsets
    n = offsets.shape[0]
    ends = offsets.tolist() if n <= _FEW else (int(offsets[0]), int(offsets[-1]))  # ints: one call for a few
    if _NESTED is None or n < 2 or ends[0] != 0 or values.shape[0] != ends[-1]:
        return column.to_nested()
    return _NESTED(values, offsets)


def open_shard(store: Store, name: str, c: Check, field: str) -> Any:
    """Open a shard named by ``field`` of ``c``'s file; a name that is not a shard's (a path) is refused unopened."""
    if not SHARD_NAME.fullmatch(name):
        raise c.fail(field, "a shard file name like 'shard-00000.safetensors' (no directory)", name)
    return SafetensorsFile(store.open(name))


def read_segment(store: Store, segment: dict, layout: Layout) -> tuple[torch.Tensor, list, list]:
    """Read one segment's ``(frame_idx, tensor leaves, JSON leaves)`` as ``layout`` holds them, touching only its rows.

    The group may be stored with ``layout``, or with a layout that ``layout`` promotes (a leaf stored
    fixed that is ragged in ``layout``: read without a copy, `promote_columns`). The segment, the
    shard's name and header, and the group's tensors are checked first; a malformed one raises
    `DatasetError`.
    """
    c = Check(store.where)
    shard, group, lo, count = check_segment(segment, c, "segment")
    s = Check(store.path(shard))
    with open_shard(store, shard, c, "segment.shard") as f:
        desc = shard_groups(f, s).get(group)
        stored = None if desc is None else check_layout(desc, s, f"__metadata__.groups[{group!r}]")
        if stored is None or (stored != layout and common_layout(stored, layout) != layout):
            raise s.fail(f"__metadata__.groups[{group!r}]", f"{layout.describe()} (or a layout it promotes)", desc)
        n = check_group(f, s, group, stored)
        if lo + count > n:
            raise c.fail("segment", f"start + frames <= {n}, the rows of {group} in {shard}", lo + count)
        idx, tensors, json_values = read_rows(f, s, names_in(f, s, group, stored), stored, lo, lo + count)
        return idx, promote_columns(stored, layout, tensors), json_values


def cat_columns(columns: list) -> Any:
    """Columns of one leaf (tensors, or `Ragged`) joined, frames in order."""
    return Ragged.cat(columns) if isinstance(columns[0], Ragged) else torch.cat(columns)


def offsets_of_rows(f: Any, c: Check, names: GroupNames, name: str, lo: int, hi: int) -> tuple[torch.Tensor, Any]:
    """The offsets of rows ``lo:hi`` of a blob (a ragged leaf's values, JSON lines), and the blob, unread.

    The offsets are checked (non-decreasing, inside the blob) before anything else is read.
    """
    offsets_name = names.offsets(name)
    offsets = f.get_slice(offsets_name)[lo : hi + 1]
    blob = f.get_slice(name)
    _check_offsets(offsets, blob.get_shape()[0], c, offsets_name, lo, hi)
    return offsets, blob


_FEW = 64  # offsets checked as Python ints up to this many (a few torch calls cost more)


def _check_offsets(offsets: torch.Tensor, size: int, c: Check, field: str, lo: int, hi: int) -> list[int] | None:
    """Refuse ``offsets`` unless non-decreasing and inside ``0..size``; returns them as ints when there are few."""
    few = offsets.tolist() if offsets.numel() <= _FEW else None
    if few is not None:
        ok = not few or (few[0] >= 0 and few[-1] <= size and all(a <= b for a, b in zip(few, few[1:], strict=False)))
    else:
        ok = not bool((offsets.diff() < 0).any()) and int(offsets[0]) >= 0 and int(offsets[-1]) <= size
    if not ok:
        raise c.fail(field, f"non-decreasing offsets in 0..{size} (rows {lo}..{hi})", offsets.tolist()[:20])
    return few


def read_span(f: Any, c: Check, names: GroupNames, name: str, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``lo:hi`` of a blob with offsets, read once their offsets are checked; and the offsets."""
    offsets, _, values = _span(f, c, names, name, lo, hi)
    return offsets, values


def _span(f: Any, c: Check, names: GroupNames, name: str, lo: int, hi: int) -> tuple[torch.Tensor, list | None, Any]:
    """`read_span`, with the offsets as ints too when they are few (else None)."""
    offsets_name = names.offsets(name)
    offsets = f.get_slice(offsets_name)[lo : hi + 1]
    blob = f.get_slice(name)
    few = _check_offsets(offsets, blob.get_shape()[0], c, offsets_name, lo, hi)
    first, last = (few[0], few[-1]) if few else (int(offsets[0]), int(offsets[-1])) if offsets.numel() else (0, 0)
    return offsets, few, blob[first:last]


def own(t: torch.Tensor) -> torch.Tensor:
    """Rows read, in memory of their own where they are a small part of the tensor they come from.

    safetensors' slices view the whole tensor's mapping: kept, they keep it alive, and pickled (a
    DataLoader worker's result) they would take the whole tensor with them.
    """
    return t.clone() if t.untyped_storage().nbytes() > 2 * t.nbytes + 4096 else t


def read_rows(f: Any, c: Check, names: GroupNames, layout: Layout, lo: int, hi: int) -> tuple[torch.Tensor, list, list]:
    """Rows ``lo:hi`` of a group (its tensor ``names``) whose header is checked; offsets, JSON lines checked as read."""
    idx = own(f.get_slice(names.frame_idx)[lo:hi])
    tensors: list[Any] = []
    for name, leaf in zip(names.leaves, layout.leaves, strict=True):
        if leaf.ragged:
            offsets, few, values = _span(f, c, names, name, lo, hi)
            tensors.append(Ragged(own(values), offsets - (few[0] if few else offsets[0])))
        else:
            tensors.append(own(f.get_slice(name)[lo:hi]))
    json_values = []
    for name in names.json:
        offsets, few, blob = _span(f, c, names, name, lo, hi)
        bounds = few if few is not None else offsets.tolist()
        data = blob.numpy().tobytes()
        at = [b - bounds[0] for b in bounds]
        lines = (data[a:b] for a, b in zip(at, at[1:], strict=False))
        json_values.append([json_scalar(line, c, f"{name} row {lo + r}") for r, line in enumerate(lines)])
    return idx, tensors, json_values


def read_picked(
    f: Any, c: Check, names: GroupNames, layout: Layout, rows: torch.Tensor
) -> tuple[torch.Tensor, list, list]:
    """Rows ``rows`` of a group (int64, in any order, repeats allowed): `read_rows` of each, joined in that order.

    A mapped shard (a local file) is read by one gather per tensor from a view of the span the
    rows cover, copying only their bytes; another source (an object store) by one `read_rows` per
    run of consecutive rows. Each row's offsets (its own pair) are checked, in order and inside
    the blob, before its values are read.
    """
    if not getattr(getattr(f, "source", None), "mapped", False) or not rows.numel():
        return _read_runs(f, c, names, layout, rows)
    lo, hi = int(rows.min()), int(rows.max()) + 1
    at = rows - lo  # the rows in the span lo:hi, which the header check made sure the group has
    idx = f.get_slice(names.frame_idx)[lo:hi].index_select(0, at)
    tensors: list[Any] = []
    for name, leaf in zip(names.leaves, layout.leaves, strict=True):
        if leaf.ragged:
            starts, lengths, blob = _picked_offsets(f, c, names, name, lo, hi, rows)
            values = blob[: blob.get_shape()[0]].index_select(0, element_index(starts, lengths))
            tensors.append(Ragged.from_lengths(values, lengths))
        else:
            tensors.append(f.get_slice(name)[lo:hi].index_select(0, at))
    json_values = []
    for name in names.json:
        starts, lengths, blob = _picked_offsets(f, c, names, name, lo, hi, rows)
        data = blob[: blob.get_shape()[0]].numpy()
        spans = zip(starts.tolist(), (starts + lengths).tolist(), rows.tolist(), strict=True)
        json_values.append([json_scalar(data[a:b].tobytes(), c, f"{name} row {r}") for a, b, r in spans])
    return idx, tensors, json_values


def _picked_offsets(
    f: Any, c: Check, names: GroupNames, name: str, lo: int, hi: int, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Each of ``rows``' first offset and length in a blob, checked (in order, inside it); and the blob, unread."""
    offsets_name = names.offsets(name)
    span = f.get_slice(offsets_name)[lo : hi + 1]
    blob = f.get_slice(name)
    size = blob.get_shape()[0]
    at = rows - lo
    starts, ends = span.index_select(0, at), span.index_select(0, at + 1)
    bad = (ends < starts) | (starts < 0) | (ends > size)
    if bool(bad.any()):
        k = int(bad.nonzero()[0])
        r = int(rows[k])
        raise c.fail(
            offsets_name, f"non-decreasing offsets in 0..{size} (rows {r}..{r + 1})", [int(starts[k]), int(ends[k])]
        )
    return starts, ends - starts, blob


def _read_runs(
    f: Any, c: Check, names: GroupNames, layout: Layout, rows: torch.Tensor
) -> tuple[torch.Tensor, list, list]:
    """`read_picked` by `read_rows`: one read per run of consecutive rows, then the rows picked in their order."""
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    u = unique.tolist()
    cuts = [0, *[k for k in range(1, len(u)) if u[k] != u[k - 1] + 1], len(u)]
    pieces = [read_rows(f, c, names, layout, u[a], u[b - 1] + 1) for a, b in zip(cuts, cuts[1:], strict=False)]
    if not pieces:
        return read_rows(f, c, names, layout, 0, 0)
    if len(pieces) == 1 and len(u) == len(rows) and u == rows.tolist():  # one run, in order: as read
        return pieces[0]
    idx = torch.cat([p[0] for p in pieces]).index_select(0, inverse)
    tensors = [cat_columns([p[1][j] for p in pieces]).index_select(0, inverse) for j in range(len(layout.leaves))]
    picks = inverse.tolist()
    json_values = []
    for j in range(len(names.json)):
        values = [v for p in pieces for v in p[2][j]]
        json_values.append([values[k] for k in picks])
    return idx, tensors, json_values
