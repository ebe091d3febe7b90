"""`Output`: how one run's files become a dataset. The commit seam.

A run stages its shards, then commits them in one conditional step: the index, which lists every
shard, is published only if every shard it lists is there and no other run committed since this
one opened. Until then a reader sees the dataset as it was; a run that fails leaves what it
staged for a resume (`abort`), or nothing (`discard`). Every store's output implements this:

- `tdgather.storage.local.LocalOutput` (a store with ``atomic_rename``): shards staged in
  ``<name>.partial``; the commit writes the index there and renames the directory into place;
- `tdgather.storage.prefix.PrefixOutput` (an object store): shards written under the prefix with
  names of their run; the commit is the index's `tdgather.storage.store.Store.put_if`;
- `tdgather.storage.append.AppendOutput` (``append=True``, any store): a job's shards named by its
  run beside the others'; the commit is the next snapshot's ``put_if`` (absent), retried on a loss.

`output_at` picks one for a path. The call order, by rank dst (the one writer, or the coordinator
with ``ranks_per_writer``; `tdgather.storage.writer.DatasetWriter` drives it):

1. ``open(overwrite, resume)``: check what is at the target (only tdgather's files are ever
   replaced), claim the staging place, mark it with this run (`tdgather.storage.runmark`); return
   the `RunState` to continue from (a resume) or a fresh one. Another writer calls ``join()``
   instead: the names of the shards already staged there.
2. ``store.put(shard, ...)`` for each shard (names carry the run where ``tag``).
3. One of: ``commit(index, shards)``, the one commit step (`OutputError`, and nothing committed,
   when a listed shard is missing or another run committed meanwhile; the error names it);
   ``abort(record)``, keep the shards with the incomplete record for a resume; ``discard(shards)``,
   remove what this run staged.
4. ``close()``: release what ``open`` holds (a lock).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from .append import AppendOutput
from .atomic import LocalFS
from .local import LocalOutput
from .location import store_at
from .prefix import PrefixOutput
from .runstate import RunState
from .store import Store

__all__ = ["Output", "output_at"]


class Output(Protocol):
    """Where one run's files go, and how they are committed (the call order is the module's).

    Attributes:
        target: the dataset's path or URL, as messages name it.
        store: where the run's shards are put (a staging directory, or the prefix itself).
        tag: shard names carry the run and attempt (a prefix that several runs write).
        overwrite: an existing dataset is replaced at commit.
        replaces: the run id of the dataset the commit replaces (recorded in the index), if known.
        run: this run's id, once open.
    """

    target: Path | str
    store: Store
    tag: bool
    overwrite: bool
    replaces: str | None
    run: str | None

    def open(self, overwrite: bool, resume: bool) -> RunState:
        """Check the target, claim the staging place, mark it with this run; what to continue from."""

    def join(self) -> list[str]:
        """Another writer joins rank dst's run (instead of ``open``): the shards already staged there."""

    def commit(self, index: Iterable[bytes], shards: Iterable[str]) -> Path | str:
        """The one commit step: the index published if every shard is there and no other run committed since open."""

    def abort(self, record: Iterable[bytes] | None) -> Path | str:
        """Keep what was staged, with the incomplete record if given; where it is."""

    def discard(self, shards: Iterable[str]) -> None:
        """Remove what this run staged (``shards``), unless it was committed."""

    def close(self) -> None:
        """Release what ``open`` holds."""


def output_at(
    path: Any,
    storage_options: dict | None = None,
    fs: LocalFS | None = None,
    store: Store | None = None,
    append: bool = False,
) -> Output:
    """Where a dataset at ``path`` is written: `LocalOutput` for a store with ``atomic_rename``, else `PrefixOutput`.

    ``append``: `AppendOutput`, a job's frames added as a new snapshot (any store with an atomic
    ``put_if``). ``fs``: the local filesystem seam; ``store``: the object store itself (a test's
    double), for a URL.
    """
    store = store or store_at(path, storage_options)
    if append:
        return AppendOutput(store)
    return LocalOutput(path, fs) if store.atomic_rename else PrefixOutput(store)
