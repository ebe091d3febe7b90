"""One source's frames of one layout, as rank dst plans them: `Part`."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from .frames import Layout

__all__ = ["Part"]


@dataclass
class Part:
    """One source's frames of one layout, rows in the order they were added or sent.

    Row ``r`` belongs to filename ``files[file_ids[r]]``. ``chunks`` holds the tensor leaves as
    consecutive batches of rows (``chunks[c][j]`` is leaf ``j`` of batch ``c``); it is empty while
    the payload is still on the wire. A ragged leaf ``j``'s chunks hold its values' rows, and
    ``lengths[j]`` (int64 ``[n]``) how many each frame has; ``lengths`` is empty when no leaf is
    ragged, else None for each leaf that is not. ``row_rank`` (int32 ``[n]``), where given, is each
    row's sender: a merge's result taken back in as a part (`tdgather.core.merge.as_parts`) holds
    rows of several ranks; else every row is ``rank``'s.
    """

    rank: int
    layout: Layout
    files: list[str]
    file_ids: torch.Tensor  # int64 [n]
    frame_idx: torch.Tensor  # int64 [n]
    json: list[list]
    chunks: list[list[torch.Tensor]] = field(default_factory=list)
    lengths: list[torch.Tensor | None] = field(default_factory=list)
    row_rank: torch.Tensor | None = None

    @property
    def num_frames(self) -> int:
        """Frames in the part."""
        return self.frame_idx.numel()

    @property
    def value_rows(self) -> int:
        """Rows of its ragged leaves' values, all leaves together."""
        return sum(int(n.sum()) for n in self.lengths if n is not None)

    @property
    def nbytes(self) -> int:
        """Tensor bytes of its frames."""
        return self.nbytes_of()

    def nbytes_of(self, rows: torch.Tensor | None = None) -> int:
        """Tensor bytes of the frames ``rows`` (a bool per frame) picks; of every frame without ``rows``."""
        values = [
            int((n if rows is None else n[rows]).sum()) * leaf.row_nbytes
            for leaf, n in zip(self.layout.leaves, self.lengths, strict=False)
            if n is not None
        ]
        frames = self.num_frames if rows is None else int(rows.sum())
        return frames * self.layout.frame_nbytes + sum(values)

    def ranks(self) -> torch.Tensor:
        """int32 ``[n]``: each row's sender."""
        if self.row_rank is not None:
            return self.row_rank
        return torch.full((self.num_frames,), self.rank, dtype=torch.int32)

    def rank_of(self, name: str) -> int:
        """The sender of the first row of ``name`` (``rank``, unless the rows came from several ranks)."""
        return self.rank if self.row_rank is None else self._first_ranks[name]

    @cached_property
    def _first_ranks(self) -> dict[str, int]:
        n = self.num_frames
        first = torch.full((len(self.files),), n, dtype=torch.int64)
        first.scatter_reduce_(0, self.file_ids, torch.arange(n), "amin")
        used = (first < n).nonzero().flatten()
        ranks = self.row_rank.index_select(0, first[used]).tolist()
        return {self.files[i]: r for i, r in zip(used.tolist(), ranks, strict=True)}

    @cached_property
    def names(self) -> list[str]:
        """The filenames its rows use (found once: placement and merge both ask)."""
        used = torch.bincount(self.file_ids, minlength=len(self.files)).nonzero().flatten()  # no sort, ids in order
        return [self.files[i] for i in used.tolist()]
