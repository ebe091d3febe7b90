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
from ..core.ragged import Ragged
from ..format.check import Check, check_group, check_layout, check_segment, json_scalar, names_in, shard_groups
from ..format.codec import SafetensorsFile
from ..format.names import SHARD_NAME, GroupNames, group_names
from .store import Store

__all__ = ["OpenShard", "cat_columns", "offsets_of_rows", "open_shard", "read_rows", "read_segment", "read_span"]


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
    size = blob.get_shape()[0]
    if bool((offsets.diff() < 0).any()) or int(offsets.min()) < 0 or int(offsets.max()) > size:
        raise c.fail(offsets_name, f"non-decreasing offsets in 0..{size} (rows {lo}..{hi})", offsets.tolist()[:20])
    return offsets, blob


def read_span(f: Any, c: Check, names: GroupNames, name: str, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``lo:hi`` of a blob with offsets, read once their offsets are checked; and the offsets."""
    offsets, blob = offsets_of_rows(f, c, names, name, lo, hi)
    return offsets, blob[int(offsets[0]) : int(offsets[-1])]


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
            offsets, values = read_span(f, c, names, name, lo, hi)
            tensors.append(Ragged(own(values), offsets - offsets[0]))
        else:
            tensors.append(own(f.get_slice(name)[lo:hi]))
    json_values = []
    for name in names.json:
        offsets, blob = read_span(f, c, names, name, lo, hi)
        bounds = offsets.tolist()
        data = blob.numpy().tobytes()
        at = [b - bounds[0] for b in bounds]
        lines = (data[a:b] for a, b in zip(at, at[1:], strict=False))
        json_values.append([json_scalar(line, c, f"{name} row {lo + r}") for r, line in enumerate(lines)])
    return idx, tensors, json_values
