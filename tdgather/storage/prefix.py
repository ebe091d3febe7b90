"""`PrefixOutput`: how a dataset is committed to an object store, where nothing can be renamed.

Rules (checked by rank dst before any frame moves):

1. the prefix holds nothing, or only tdgather's objects (shards, the index, an incomplete
   record): a complete dataset (replaced only with ``overwrite=True``) or a failed run's objects
   (continued with ``resume=True``, or removed with ``overwrite=True``); anything else under it,
   even in a "subdirectory", is refused, even with ``overwrite=True``;
2. every shard's name carries its run and attempt (`tdgather.format.names.shard_name`): a run never
   writes over another's objects;
3. the index is written last, as one object (one PUT): the one commit point. A reader trusts only
   the shards it lists. Then the shards it does not list of this run and of the run it replaced
   are removed, by name (another run's are never touched). A crash before that leaves them: the
   index names the run it replaced (``metadata.replaces``), so its leftovers are never taken for
   a failed run's;
4. a failed run writes ``tdgather.incomplete.json`` beside the shards and no index (an old
   dataset's index, if any, stays: ``tdgather.open(url)`` still reads the old dataset).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import DatasetError, OutputError
from ..format.check import Check, load_json
from ..format.names import FORMAT, INCOMPLETE_NAME, INDEX_NAME, RUN_TAG, SHARD_NAME, SHARD_PATTERN, shard_tag
from .outdir import describe_names
from .recovery import RunState, from_index, from_shards, index_runs, loose_shards, new_run
from .store import Store

__all__ = ["OURS", "PrefixOutput"]

OURS = re.compile("(" + SHARD_PATTERN + "|" + re.escape(INDEX_NAME) + "|" + re.escape(INCOMPLETE_NAME) + ")")


class PrefixOutput:
    """A dataset under an object store prefix: shards written in place, the index last.

    Attributes:
        target: the dataset's URL.
        store: the prefix, where shards are written.
        tag: shard names carry their run and attempt.
        overwrite: an existing dataset is replaced at commit.
        replaces: the run id of the dataset the commit replaces (recorded in the index).
    """

    tag = True

    def __init__(self, store: Store) -> None:
        self.store = store
        self.target = store.where
        self.overwrite = False
        self.replaces: str | None = None
        self.run: str | None = None  # known once open
        self._replaced: set[str] = set()  # the shards the replaced dataset's index lists

    def open(self, overwrite: bool, resume: bool) -> RunState:
        """Check the prefix; return what it holds to continue from, or a fresh run (a failed run's objects removed)."""
        listing = self.store.list()
        foreign = sorted(n for n in listing if not OURS.fullmatch(n))
        if foreign:
            raise OutputError(
                f"output {self.target!r} holds objects tdgather did not write ({describe_names(foreign)}); tdgather "
                "never replaces or deletes what it did not write, even with overwrite=True: choose another prefix, "
                "or move those objects away"
            )
        listed, index_run, _ = index_runs(self.store)
        complete = INDEX_NAME in listing
        loose = loose_shards(self.store, listing)
        failed = bool(loose) or INCOMPLETE_NAME in listing and not complete
        if complete and not overwrite and not resume:
            raise OutputError(
                f"output {self.target!r} already holds a tdgather dataset; pass overwrite=True to replace it "
                "(the new index replaces the old in one step, once the new dataset is complete), or choose another path"
            )
        if failed and not overwrite and not resume:
            raise OutputError(
                f"output {self.target!r} holds shards left by an interrupted run (not listed by any index); continue "
                "that run with resume=True, or pass overwrite=True to start over (read what it saved with "
                "tdgather.open(url, incomplete=True))"
            )
        if resume and loose:
            if complete and not overwrite:
                raise OutputError(
                    f"{self.target!r} holds what a failed run saved beside a complete dataset, which finishing that "
                    "run would replace: pass overwrite=True as well as resume=True to do so"
                )
            state = from_shards(self.store, loose)
            self.overwrite, self.replaces = complete, index_run if index_run != state.run else None
            self._replaced = listed
            self.run = state.run
            return state
        if resume and complete:
            self.overwrite = True  # the new index lists the old shards and the new ones
            self.replaces = index_runs(self.store)[2]  # still the replaced run's: its leftovers stay known
            state = from_index(self.store)
            self.run = state.run
            return state
        record = [INCOMPLETE_NAME] if INCOMPLETE_NAME in listing else []
        self._check_ours(loose + record)
        for name in loose + record:  # overwrite=True (or nothing of use): a failed run's objects go now, by name
            self.store.remove(name)
        self.overwrite, self.replaces, self._replaced = complete, index_run, listed
        self.run = new_run()
        return RunState(self.run)

    def _check_ours(self, names: list[str]) -> None:
        """Refuse, before anything is removed, an object named like tdgather's that tdgather did not write."""
        for name in names:
            try:
                if name == INCOMPLETE_NAME:
                    c = Check(self.store.path(name))
                    ok = c.mapping(load_json(self.store.read(name), c, "index"), "index").get("format") == FORMAT
                else:
                    with self.store.open_safetensors(name) as f:
                        ok = (f.metadata() or {}).get("format") == FORMAT
            except DatasetError:
                ok = False
            if not ok:
                raise OutputError(
                    f"output {self.target!r} holds {name!r}, named like tdgather's files but not one tdgather wrote "
                    "(not a tdgather shard or record); tdgather never deletes what it did not write, even with "
                    "overwrite=True: choose another prefix, or move it away"
                )

    def open_part(self) -> list[str]:
        """Another writer's part: nothing to check (it writes its own objects); no shard of its tag exists yet."""
        return []

    def commit(self, index: Iterable[bytes], shards: Iterable[str]) -> str:
        """Write the index in one PUT (the commit), then remove the objects it does not list; return the URL."""
        self.store.put(INDEX_NAME, [b"".join(index)])
        keep = set(shards)
        ours = {run[:RUN_TAG] for run in (self.run, self.replaces) if run}
        for name in sorted(self.store.list()):  # by name, only tdgather's: never anything it did not write
            if name == INCOMPLETE_NAME:
                self.store.remove(name)
            elif SHARD_NAME.fullmatch(name) and name not in keep:
                if (shard_tag(name) or ("",))[0] in ours or name in self._replaced:
                    self.store.remove(name)  # this run's, or the replaced dataset's (untagged: one copied there)
        return self.target

    def abort(self, record: Iterable[bytes] | None) -> str:
        """Leave the shards, with the incomplete record if given; return the URL."""
        if record is not None:
            self.store.put(INCOMPLETE_NAME, [b"".join(record)])
        return self.target

    def discard(self, shards: Iterable[str]) -> None:
        """Remove this run's shards (``shards``), unless the index lists them."""
        listed, _, _ = index_runs(self.store)
        for name in shards:
            if name not in listed:
                self.store.remove(name)

    def close(self) -> None:
        """Nothing is held."""
