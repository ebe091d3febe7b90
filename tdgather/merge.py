"""Stage 4b, merge: parts already in memory into sorted, columnar groups.

Used where payloads are in memory before they are placed: rank dst's own frames, and each
spill of a `tdgather.Collector`. Per layout:

1. plan every row's place from the frame indexes (`tdgather.plan.place`, lowest rank first,
   so the first copy of a frame is the lowest rank's);
2. scatter each part's batches into one new buffer per leaf;
3. compare every later copy with the first and resolve it by the `tdgather.duplicates` policy
   (kept once and counted by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .duplicates import DuplicateCounts
from .frames import Frames
from .plan import Group, Part, place, scatter_chunks

__all__ = ["Merged", "merge"]


@dataclass
class Merged:
    """The result of a merge.

    Attributes:
        groups: the frames, one `Group` per layout.
        duplicates: the copies dropped.
        ranks: for each filename, the ranks that sent frames of it.
    """

    groups: list[Group]
    duplicates: DuplicateCounts = field(default_factory=DuplicateCounts)
    ranks: dict[str, set[int]] = field(default_factory=dict)

    @property
    def files(self) -> dict[str, Frames]:
        """``{filename: Frames}``, filenames sorted (views of the groups)."""
        out = {name: g.frames(i) for g in self.groups for i, name in enumerate(g.files)}
        return dict(sorted(out.items()))


def merge(parts: list[Part], duplicates: Any = "keep") -> Merged:
    """Merge parts whose payloads are in memory, in the order given (the first copy of a frame is kept).

    Raises:
        ShapeMismatchError: two ranks sent one filename with different layouts.
        DuplicateFrameError: copies of one ``(filename, frame_idx)`` that the policy refuses.
    """
    groups, found = [], DuplicateCounts()
    for placement, members in place(parts):
        buffers = placement.allocate()
        for part, dest in zip(members, placement.dest, strict=True):
            scatter_chunks(buffers, dest, part.chunks)
        found += placement.check_duplicates(buffers, duplicates)
        groups.append(placement.group(buffers))
    return Merged(groups, found, ranks_of(parts))


def ranks_of(parts: list[Part]) -> dict[str, set[int]]:
    """For each filename, the ranks whose parts hold frames of it."""
    ranks: dict[str, set[int]] = {}
    for part in parts:
        for name in part.names:
            ranks.setdefault(name, set()).add(part.rank)
    return ranks
