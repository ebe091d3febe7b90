"""`LocalOutput`: how a dataset is committed to a local (or mounted) directory.

Shards are written into ``<name>.partial`` beside the target (`tdgather.storage.outdir` has the
rules: what may be replaced, the lock, deleting only tdgather's files). The index is written
last; then the staging directory is moved into place in one step, or exchanged with an old
dataset atomically. A failed run leaves its shards there, listed in ``tdgather.incomplete.json``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import OutputError
from ..format.names import INCOMPLETE_NAME, INDEX_NAME, RUN_NAME
from .atomic import LocalFS
from .location import local_path
from .outdir import check_output, describe_names, lock_dir, publish, remove_ours, staging_of
from .resume import load_state
from .runmark import RunMark
from .runstate import RunState, new_run
from .scan import index_runs, shard_files
from .snapshots import check_not_appended
from .store import LocalStore

__all__ = ["LocalOutput"]


class LocalOutput:
    """A dataset directory on a local filesystem: staged in ``<name>.partial``, moved into place.

    The `tdgather.storage.output.Output` of a store with ``atomic_rename`` (its call order is there).

    Attributes:
        target: the dataset directory.
        store: the staging directory, where shards are written.
        tag: shard names carry their run (never: a run's staging directory is its own).
        overwrite: an existing dataset is replaced at commit.
    """

    tag = False
    replaces = None
    run: str | None = None  # known once open

    def __init__(self, path: Any, fs: LocalFS | None = None) -> None:
        self.target = local_path(path)
        self.staging = staging_of(self.target)
        self.fs = fs or LocalFS()
        self.store = LocalStore(self.staging, self.fs)
        self.overwrite = False
        self._lock: int | None = None
        self._base: str | None = None

    def open(self, overwrite: bool, resume: bool) -> RunState:
        """Check the output, lock ``<path>.partial``; return what it holds to continue from, or a fresh run."""
        check_not_appended(LocalStore(self.target), self.target)
        check_output(self.target, overwrite, resume)
        self._base = LocalStore(self.target).version(INDEX_NAME)  # the commit checks no other run committed since
        self._lock = lock_dir(self.staging) if self.staging.is_dir() else None
        try:
            state = load_state(self.target, self.staging, overwrite) if resume else None
            if state is None:
                remove_ours(self.staging)  # check_output allowed only tdgather's own files there
                self.staging.mkdir()
                self.close()  # the removed directory's
                state = RunState(new_run())
            if self._lock is None:  # a new staging directory (fresh, or made from a complete dataset)
                self._lock = lock_dir(self.staging)
        except BaseException:
            self.close()
            raise
        # resuming a complete dataset replaces it with one that holds all its frames
        self.overwrite = overwrite or (resume and (self.target / INDEX_NAME).is_file())
        self.run = state.run
        RunMark.now(state.run, self.overwrite).put(self.store)  # before any shard: a resume continues this run
        return state

    def join(self) -> list[str]:
        """Another writer joins the run: the staging directory rank dst made must be visible; its shards' names."""
        if not self.staging.is_dir():
            raise OutputError(
                f"{str(self.staging)!r}, which rank dst made, is not there as this rank sees it: with "
                "ranks_per_writer, every writer writes into one output directory, on a filesystem all of them "
                "share (or write to an object store URL, or use one Collector per node, each with its own path)"
            )
        return shard_files(self.store)

    def commit(self, index: Iterable[bytes], shards: Iterable[str]) -> Path:
        """Check every listed shard is staged and no other run committed; write the index, move it into place.

        Raises:
            OutputError: a listed shard is missing, or another run committed meanwhile; nothing was committed.
        """
        missing = sorted(set(shards) - set(self.store.list()))
        if missing:
            raise OutputError(
                f"{str(self.staging)!r}: the index would list {describe_names(missing)}, which are not there "
                "(removed by another process); nothing was committed: rerun with resume=True"
            )
        if LocalStore(self.target).version(INDEX_NAME) != self._base:
            _, other, _ = index_runs(LocalStore(self.target))
            raise OutputError(
                f"{str(self.target)!r}: another run (run {other}) committed a dataset there after this run (run "
                f"{self.run}) opened; that dataset stays, and this run's shards stay in {str(self.staging)!r}. Two "
                "jobs wrote one output (a requeue, a restarted pod): keep one of them"
            )
        for name in (INCOMPLETE_NAME, RUN_NAME):  # an earlier attempt's record; this run's mark
            (self.staging / name).unlink(missing_ok=True)
        self.fs.write_atomic(self.staging / INDEX_NAME, index)
        publish(self.staging, self.target, self.overwrite, self.fs.exchange)
        self.close()
        return self.target

    def abort(self, record: Iterable[bytes] | None) -> Path:
        """Keep the shards in ``<path>.partial``, with the incomplete record if given; return that path."""
        if record is not None:
            self.fs.write_atomic(self.staging / INCOMPLETE_NAME, record)
        self.close()
        return self.staging

    def discard(self, shards: Iterable[str]) -> None:
        """Remove ``<path>.partial`` and what it holds (tdgather's files only), unless it was committed."""
        if not (self.staging / INDEX_NAME).exists():
            remove_ours(self.staging)
        self.close()

    def close(self) -> None:
        """Release the lock on ``<path>.partial``."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
