"""What `tdgather.gather` returns on rank dst: the `Gathered` frames and their `GatherStats`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from ..core.duplicates import DuplicateCounts
from ..core.frames import Frames
from ..core.plan import Group

__all__ = ["GatherStats", "Gathered"]


@dataclass(frozen=True)
class GatherStats:
    """What one `gather` moved.

    Attributes:
        frames: frames in the result.
        bytes: tensor bytes received (every copy, duplicates included; of a rank that failed
            part-way, only its frames that arrived).
        duplicates_dropped: copies of a frame dropped (``duplicates.exact + duplicates.inexact``).
        frames_per_rank: frames of each rank that arrived (every one it sent, unless it failed
            part-way: then only those in ``.received``).
        seconds: the call's duration on rank ``dst``.
        duplicates: the copies dropped, exact and inexact, with the largest absolute difference.
        pieces: payload pieces received from the peers.
        written_in_place: peers on rank ``dst``'s host that copied their frames straight into the
            result (`tdgather.comm.direct`), sending no pieces.
        early_pieces: of them, those received before rank ``dst`` knew every row's place (into
            buffers of their own, scattered once it did): the transfer overlapping the placement.
    """

    frames: int
    bytes: int
    duplicates_dropped: int
    frames_per_rank: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    duplicates: DuplicateCounts = field(default_factory=DuplicateCounts)
    pieces: int = 0
    early_pieces: int = 0
    written_in_place: int = 0


class Gathered(Mapping[str, Frames]):
    """The gathered ``{filename: Frames}``, sorted by filename, with ``stats``.

    The frames are held per layout, columnar (``groups``, as rank dst placed them); a filename's
    `Frames` (views of those buffers) is built when it is first accessed. `tdgather.save` writes
    the groups as they are.
    """

    def __init__(self, groups: list[Group], stats: GatherStats | None = None) -> None:
        self.groups = groups
        where = {name: (g, i) for g in groups for i, name in enumerate(g.files)}
        self._where = dict(sorted(where.items()))
        self._built: dict[str, Frames] = {}
        self.stats = stats or GatherStats(0, 0, 0)

    def __getitem__(self, name: str) -> Frames:
        frames = self._built.get(name)
        if frames is None:
            group, i = self._where[name]
            frames = self._built[name] = group.frames(i)
        return frames

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __repr__(self) -> str:
        return f"Gathered({len(self)} filenames, {self.stats.frames} frames)"
