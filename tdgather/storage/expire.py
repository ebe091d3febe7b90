"""`expire`: old snapshots of a dataset that jobs append to removed, and the shards only they listed.

Appends and compactions never remove a file (`tdgather.storage.append`, `tdgather.storage.compact`):
each snapshot keeps reading as it was committed. Expiry is what frees storage, by one rule:

1. the newest snapshot is always kept;
2. an older snapshot is kept while it was **superseded** (the next snapshot was made) less than
   ``older_than`` ago: a reader that opened it while it was the newest has had ``older_than`` to
   finish; every other snapshot expires;
3. a shard is removed only when an expired snapshot lists it and no kept snapshot does: after an
   append every shard stays listed (a snapshot lists all its parent's shards), so only a
   compaction's replaced shards, and the unlisted rows in them, ever go;
4. the shards a snapshot lists are removed before the snapshot itself, so an expiry that is
   killed leaves no kept snapshot without its shards; run it again to finish;
5. shards that no snapshot lists (jobs killed before their commit, or still running), and the
   temporary files of writes that were killed, are removed only with ``orphans=True``, and then
   whatever their age: use it only while no job appends or compacts (one that is running loses
   its shards and refuses to commit). A file named like a shard that tdgather did not write is
   refused (`OutputError`), before anything is removed.

A `tdgather.Dataset` kept open on a snapshot that has since expired raises `OutputError` (naming
the snapshot and telling to open the dataset again) when it reads a shard that was removed;
``tdgather.open(path, version=n)`` of an expired snapshot raises `OutputError` listing the
versions there are. The times are the snapshots' ``made`` (UTC, written by the committing host's
clock) against this host's clock: keep ``older_than`` well above the clocks' skew.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ..errors import DatasetError, OutputError
from ..format.codec import SafetensorsFile
from ..format.names import FORMAT, OURS, SHARD_NAME
from .atomic import final_name
from .location import store_at
from .snapshots import read_snapshot, snapshot_file, snapshot_numbers
from .store import Store

__all__ = ["DEFAULT_OLDER_THAN", "Expired", "expire"]

DEFAULT_OLDER_THAN = timedelta(days=7)  # how long a superseded snapshot stays readable by default


@dataclass(frozen=True)
class Expired:
    """What `expire` removed (or, with ``dry_run``, would remove).

    Attributes:
        snapshots: the versions of the snapshots removed, oldest first.
        kept: the versions kept, oldest first (the newest among them).
        shards: the shard files removed.
        bytes: their size in all.
    """

    snapshots: tuple[int, ...]
    kept: tuple[int, ...]
    shards: tuple[str, ...]
    bytes: int


def expire(
    path: str | os.PathLike,
    storage_options: dict | None = None,
    *,
    older_than: timedelta | float = DEFAULT_OLDER_THAN,
    orphans: bool = False,
    dry_run: bool = False,
    now: datetime | None = None,
    store: Store | None = None,
) -> Expired:
    """Remove the snapshots superseded more than ``older_than`` ago, and the shards only they list (the module's rules).

    Args:
        path: the dataset (a directory, or an object store URL).
        storage_options: for an object store URL, the filesystem's options (fsspec's).
        older_than: how long a superseded snapshot stays (a `timedelta`, or seconds); 0 expires every
            snapshot but the newest at once.
        orphans: also remove the shards no snapshot lists (only while no job appends or compacts).
        dry_run: remove nothing; say what would go.
        now: the time to compare with (default this host's clock, UTC).
        store: the store itself (a test's double); default the one ``path`` names.

    Raises:
        OutputError: no snapshot there.
        DatasetError: a snapshot is malformed (nothing is removed).
    """
    store = store or store_at(path, storage_options)
    limit = older_than if isinstance(older_than, timedelta) else timedelta(seconds=float(older_than))
    if limit < timedelta(0):
        raise ValueError(f"older_than: expected a duration >= 0, got {older_than!r}")
    now = now or datetime.now(UTC)
    listing = store.list()
    numbers = snapshot_numbers(store, listing)
    if not numbers:
        raise OutputError(f"{str(path)!r} holds no tdgather dataset (no snapshot and no index): nothing to expire")
    read = {n: read_snapshot(store, n) for n in numbers}  # every snapshot read and checked before anything goes
    made = {n: (index.get("snapshot") or {}).get("made") for n, index in read.items()}
    listed = {n: set(index["shards"]) for n, index in read.items()}
    gone = [n for n, after in zip(numbers, numbers[1:], strict=False) if _superseded(made[after], now, limit)]
    kept = [n for n in numbers if n not in gone]
    keep = set().union(*(listed[n] for n in kept))
    shards = set().union(*(listed[n] for n in gone)) - keep
    if orphans:
        every = set().union(*listed.values())
        loose = sorted(n for n in listing if SHARD_NAME.fullmatch(n) and n not in every)
        _check_ours(store, loose)
        temporary = {n for n in listing if n != final_name(n) and OURS.fullmatch(final_name(n))}  # killed writes'
        shards |= set(loose) | temporary
    shards = sorted(shards)
    size = sum(listing.get(name) or 0 for name in shards)
    if not dry_run:
        for name in shards:  # the shards first: a snapshot kept never lists a shard that is gone
            store.remove(name)
        for n in gone:
            store.remove(snapshot_file(n))
    return Expired(tuple(gone), tuple(kept), tuple(shards), size)


def _check_ours(store: Store, names: list[str]) -> None:
    """Refuse, before anything is removed, a file named like a shard that tdgather did not write.

    Raises:
        OutputError: naming it; nothing is removed.
    """
    for name in names:
        try:
            ours = SafetensorsFile(store.open(name)).metadata().get("format") == FORMAT
        except (DatasetError, OSError, ValueError):
            ours = False
        if not ours:
            raise OutputError(
                f"{store.where!r} holds {name!r}, named like a shard but not one tdgather wrote; expire never removes "
                "what tdgather did not write: move it away, then expire again (nothing was removed)"
            )


def _superseded(made: str | None, now: datetime, limit: timedelta) -> bool:
    """Whether a snapshot whose successor was ``made`` then was superseded more than ``limit`` before ``now``."""
    if made is None:
        return False
    try:
        at = datetime.fromisoformat(made)
    except ValueError:
        return False  # not a time: kept, as if made now
    return now - (at if at.tzinfo else at.replace(tzinfo=UTC)) > limit
