"""The `Sink` protocol: what receives a run's frames and makes them a dataset.

`DatasetWriter` is the implementation for a local (or mounted) filesystem. The Collector and
`tdgather.save` make their sink through a `SinkFactory` (default `DatasetWriter`), so a test or
another store plugs in there instead of patching tdgather's code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ..core.duplicates import DuplicateCounts, DuplicatePolicy
from ..core.plan import Mismatches
from .saved import Saved

__all__ = ["Sink", "SinkFactory"]


class Sink(Protocol):
    """Where one run's frames go, on rank dst (and, with ``ranks_per_writer``, on each block's writer).

    Call order, and the ranks that make each call:

    1. it is made (`SinkFactory`) on every writing rank before any frame moves: it checks the
       output and knows ``run``, ``attempt`` and ``saved`` (what earlier attempts of a resumed run
       saved, which rank dst sends every rank);
    2. ``write(frames, ranks, mismatches)``, any number of times, on the writing rank's writer
       thread: each call writes whole shards; frames already written are resolved by the policy;
    3. with several writers: a block's writer calls ``report()`` (its shards, sent to the
       coordinator), and the coordinator (rank dst) calls ``combine(reports)`` with every report;
    4. one of: ``commit(metadata)`` (the index, written last, is the one commit point; a block
       writer's commit only makes its shards durable); ``abort(failure, metadata, rank)`` (what was
       written stays, listed in the incomplete record, for ``incomplete=True`` and ``resume=True``);
       ``discard()`` (nothing was worth keeping: its files are removed).

    ``set_policy(policy)`` switches the duplicates policy, between writes (after a refused copy,
    rank dst keeps writing what arrives, one copy per frame).
    """

    run: str
    attempt: int
    saved: Saved
    duplicates: DuplicateCounts

    @property
    def frames(self) -> int:
        """Frames written so far (earlier attempts' included)."""

    @property
    def nbytes(self) -> int:
        """Their tensor bytes."""

    @property
    def shards(self) -> Mapping[str, dict]:
        """The shards written so far, by name."""

    def write(
        self, frames: Any, ranks: Mapping[str, set[int]] | None = None, mismatches: Mismatches | None = None
    ) -> list[str]:
        """Write gathered frames (a `Gathered`, merged groups, or ``{filename: Frames}``); return the shard names."""

    def set_policy(self, policy: DuplicatePolicy) -> None:
        """The duplicates policy for the writes that follow."""

    def report(self) -> dict[str, dict]:
        """A block writer's shards (name, frames, bytes, size), once durable."""

    def combine(self, reports: Mapping[int, Mapping[str, dict]]) -> DuplicateCounts:
        """The coordinator: every writer's shards into one index, copies across writers resolved."""

    def commit(self, metadata: Mapping[str, Any] | None = None) -> Path:
        """Make the dataset complete: the index last, then in place; return where it is."""

    def abort(
        self, failure: BaseException | None = None, metadata: Mapping[str, Any] | None = None, rank: int | None = None
    ) -> Path:
        """Stop: keep what was written, with the incomplete record naming ``failure``; return where it is."""

    def discard(self) -> None:
        """Remove what this run wrote (nothing of it is kept), unless it was committed."""


class SinkFactory(Protocol):
    """Makes a `Sink` for a dataset at ``path``; called with `DatasetWriter`'s keywords."""

    def __call__(self, path: Any, **kwargs: Any) -> Sink:
        """A sink for ``path``."""
