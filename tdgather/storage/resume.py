"""Resume: the state a run continues from, and what a resume would find saved.

- `load_state` (rank dst, when a Collector opens on a local path with ``resume=True``): the run
  to continue, from ``<path>.partial`` (a failed or killed attempt) or from ``<path>`` (a
  complete one, whose shards are hard-linked into ``<path>.partial``).
- `prefix_state`: what a run resumed at an object store prefix continues from.
- `saved_at`: what a resume would find saved at a path or URL, as a `Saved` (`tdgather.saved_at`).

The files are read by `tdgather.storage.scan`; reading a dataset needs nothing here.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..errors import OutputError
from ..format.names import INDEX_NAME
from .location import is_url, local_path, store_at
from .outdir import fsync_dir, staging_of
from .runmark import RunMark
from .runstate import RunState
from .saved import Saved
from .scan import from_index, from_shards, loose_shards, shard_files
from .snapshots import index_name as snapshot_file
from .store import LocalStore, Store

__all__ = ["load_state", "prefix_state", "saved_at"]

_TMP = re.compile(r"\..+\.tmp-\d+")  # a file a killed writer left half-written: never listed anywhere


def saved_at(path: str | os.PathLike, storage_options: dict | None = None) -> Saved:
    """What a Collector with ``resume=True`` would find saved at ``path`` (read on this machine).

    Use it where rank dst's output is visible (one machine, a shared filesystem, an object store),
    for example to build Lightning's predict dataloader; ``col.saved`` is the same on every rank.
    For a dataset that jobs append to: what its newest snapshot holds (``saved_at(path).todo(items)``
    is what no job has committed yet: the next task's share).
    """
    store = store_at(path, storage_options)
    newest = snapshot_file(store)
    if newest is not None and newest != INDEX_NAME:
        return from_index(store, newest).to_saved()
    if is_url(path):
        state = prefix_state(store_at(path, storage_options))
        return state.to_saved() if state is not None else Saved()
    target = local_path(path)
    state = _read(target, staging_of(target), overwrite=True)
    return state.to_saved() if state is not None else Saved()


def prefix_state(store: Store) -> RunState | None:
    """What a run resumed at this prefix continues from: a failed run's shards, else the complete dataset."""
    loose = loose_shards(store)
    if loose:
        return from_shards(store, loose)
    return from_index(store) if store.size(INDEX_NAME) is not None else None


def load_state(target: Path, staging: Path, overwrite: bool) -> RunState | None:
    """The state to continue from, with ``staging`` ready to write into; None when nothing is saved.

    Sources, in order: a complete dataset in ``staging`` (its move into place was interrupted), the
    shards a failed or killed attempt left there, or a complete dataset at ``target`` (whose shards
    are then linked into ``staging``, and which the new one replaces when complete).

    Raises:
        OutputError: both hold a complete dataset, or a failed attempt would replace a complete
            dataset without ``overwrite``.
        DatasetError: a shard or record is malformed; nothing is changed.
    """
    state = _read(target, staging, overwrite)
    if state is None:
        return None
    if not staging.is_dir():
        staging.mkdir()
    linked = [n for n in state.shards if not (staging / n).exists()]
    for name in linked:  # resuming a complete dataset (beside an empty staging directory too): from its shards
        _link(target / name, staging / name)
    if linked:
        fsync_dir(staging)
    for name in os.listdir(staging):  # what a killed writer left half-written
        if _TMP.fullmatch(name) and (staging / name).is_file():
            (staging / name).unlink()
    return state


def _read(target: Path, staging: Path, overwrite: bool) -> RunState | None:
    complete_target = (target / INDEX_NAME).is_file()
    if (staging / INDEX_NAME).is_file():
        if complete_target:
            raise OutputError(
                f"both {str(target)!r} and {str(staging)!r} hold a complete dataset (a move into place was "
                "interrupted): keep the one you want, remove the other, and resume again"
            )
        return from_index(LocalStore(staging))
    shards = shard_files(LocalStore(staging))
    if shards:
        if complete_target and not overwrite:
            raise OutputError(
                f"{str(staging)!r} holds what a failed run saved, and {str(target)!r} a complete dataset, which "
                "finishing that run would replace: pass overwrite=True as well as resume=True to do so, or move "
                "one of them away"
            )
        return from_shards(LocalStore(staging), shards)
    mark = RunMark.read(LocalStore(staging))
    if mark is not None and (mark.overwrite or not complete_target):  # a run killed before its first shard:
        return RunState(mark.run)  # continue it (a new attempt), not the dataset it was replacing
    if complete_target:
        return from_index(LocalStore(target))
    return None


def _link(src: Path, dst: Path) -> None:
    """``dst`` as a second name of ``src`` (a copy where the filesystem has no hard links)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as fh:
            os.fsync(fh.fileno())
