"""A run's id and `RunState`: what earlier attempts of a run saved, as rank dst's writer continues from it.

Every shard of a run carries its id (`new_run`), and resumed attempts keep it. A `RunState` is
read back from a dataset's files (`tdgather.storage.scan`, `tdgather.storage.resume`), or is
empty for a fresh run; `RunState.to_saved` is what every rank gets of it (`Saved`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from ..core.duplicates import DuplicateCounts
from ..core.frames import Layout
from ..format.records import Attempt
from .saved import Saved

__all__ = ["RunState", "new_run"]


def new_run() -> str:
    """A new run's id: every shard of the run carries it, and resumed attempts keep it."""
    return uuid.uuid4().hex


@dataclass
class RunState:
    """What earlier attempts saved, as rank dst's writer continues from it.

    Attributes:
        run: the run's id, in every shard's ``__metadata__`` and in the index.
        shards, files: as the index lists them (``shards[name]``: frames, bytes, groups;
            ``files[name]``: frames, segments).
        layouts: each filename's layout.
        written: per filename, the frame_idx saved, as runs (`tdgather.core.runs`).
        attempts: one `Attempt` per earlier attempt: its number, frames saved, how it ended.
        duplicates: copies of a frame in several writers' shards, dropped when read back.
    """

    run: str
    shards: dict[str, dict] = field(default_factory=dict)
    files: dict[str, dict] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    written: dict[str, torch.Tensor] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    duplicates: DuplicateCounts = field(default_factory=DuplicateCounts)  # copies dropped across writers

    @property
    def attempt(self) -> int:
        """The number of the attempt that continues from this state."""
        return max((a.attempt for a in self.attempts), default=0) + 1

    def to_saved(self) -> Saved:
        """What every rank gets: the frames saved, and each filename's layout."""
        runs = {name: r.flatten().tolist() for name, r in self.written.items()}
        return Saved(runs, {name: self.layouts[name] for name in runs})  # a name with no frame saved: none
