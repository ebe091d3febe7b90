"""`PrefixOutput`: how a dataset is committed to an object store, where nothing can be renamed.

Rules (checked by rank dst before any frame moves):

1. the prefix holds nothing, or only tdgather's objects (shards, the index, an incomplete
   record): a complete dataset (replaced only with ``overwrite=True``) or a failed run's objects
   (continued with ``resume=True``, or removed with ``overwrite=True``); anything else under it,
   even in a "subdirectory", is refused, even with ``overwrite=True``;
2. every shard's name carries its run and attempt (`tdgather.format.names.shard_name`): a run never
   writes over another's objects;
3. when it opens, before any shard, a run writes its mark (`tdgather.storage.runmark`): a resume
   continues the run the mark names unless that run committed, not the dataset it was replacing;
   opening removes nothing (a failed run's objects, or another live run's, stay until a commit);
4. the index is written last, as one object: the one commit point, and a conditional one. The run
   checks that every shard the index lists is there, then puts the index only if it is still the
   one seen at open (`Store.put_if`: S3's ``If-Match`` / ``If-None-Match``). Of two jobs on one
   prefix (a requeue while the first still runs), one commits a whole dataset and the other gets
   `OutputError` naming the run that committed. A reader trusts only the shards the index lists.
   Then the shards it does not list of this run, of the run it replaced and those left at open are
   removed, by name. A crash before that leaves them: the index names the run it replaced
   (``metadata.replaces``), so its leftovers are never taken for a failed run's;
5. a failed run writes ``tdgather.incomplete.json`` beside the shards and no index (an old
   dataset's index, if any, stays: ``tdgather.open(url)`` still reads the old dataset).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..errors import DatasetError, OutputError
from ..format.check import Check, load_json
from ..format.codec import SafetensorsFile
from ..format.names import (
    FORMAT,
    INCOMPLETE_NAME,
    INDEX_NAME,
    OURS,
    RUN_NAME,
    RUN_TAG,
    SHARD_NAME,
    shard_run,
)
from .outdir import describe_names
from .runmark import RunMark
from .runstate import RunState, new_run
from .scan import from_index, from_shards, index_runs, loose_shards
from .snapshots import check_not_appended
from .store import Store

__all__ = ["PrefixOutput"]

log = logging.getLogger("tdgather")


class PrefixOutput:
    """A dataset under an object store prefix: shards written in place, the index last.

    The `tdgather.storage.output.Output` of an object store (its call order is there).

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
        self._base: str | None = None  # the index's version at open: the commit is conditional on it
        self._stale: list[str] = []  # objects of earlier failed runs, seen at open: removed once committed

    def open(self, overwrite: bool, resume: bool) -> RunState:
        """Check the prefix, mark it with this run; return what it holds to continue from, or a fresh run.

        Nothing is removed here: a failed run's objects go once this run commits.
        """
        check_not_appended(self.store, self.target)
        listing = self.store.list()
        foreign = sorted(n for n in listing if not OURS.fullmatch(n))
        if foreign:
            raise OutputError(
                f"output {self.target!r} holds objects tdgather did not write ({describe_names(foreign)}); tdgather "
                "never replaces or deletes what it did not write, even with overwrite=True: choose another prefix, "
                "or move those objects away"
            )
        self._base = self.store.version(INDEX_NAME)
        listed, index_run, _ = index_runs(self.store)
        complete = INDEX_NAME in listing
        loose = loose_shards(self.store, listing)
        mark = RunMark.read(self.store)
        if resume and mark is not None and mark.run != index_run:  # the run that opened last did not commit:
            return self._resume(mark, loose, complete, overwrite, index_run, listed)  # continue it
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
            if len({shard_run(n) for n in loose}) > 1:  # shards of several runs, and no mark naming the last
                raise OutputError(
                    f"{self.target!r} holds shards of several interrupted runs and no {RUN_NAME} naming the last; "
                    "read them with tdgather.open(url, incomplete=True), or pass overwrite=True to start over"
                )
            if complete and not overwrite:
                raise OutputError(
                    f"{self.target!r} holds what a failed run saved beside a complete dataset, which finishing that "
                    "run would replace: pass overwrite=True as well as resume=True to do so"
                )
            state = from_shards(self.store, loose)
            self.overwrite, self.replaces = complete, index_run if index_run != state.run else None
            self._replaced = listed
            return self._opened(state, overwrite or complete)
        if resume and complete:
            self.overwrite = True  # the new index lists the old shards and the new ones
            self.replaces = index_runs(self.store)[2]  # still the replaced run's: its leftovers stay known
            return self._opened(from_index(self.store), True)
        record = [INCOMPLETE_NAME] if INCOMPLETE_NAME in listing else []
        self._check_ours(loose + record)
        # overwrite=True (or nothing of use): removed once this run commits; not those of the run that
        # opened last and did not commit, which may still be running (a second copy of one job)
        live = mark.run[:RUN_TAG] if mark is not None and mark.run != index_run else None
        self._stale = [n for n in loose + record if n == INCOMPLETE_NAME or shard_run(n) != live]
        self.overwrite, self.replaces, self._replaced = complete, index_run, listed
        return self._opened(RunState(new_run()), overwrite)

    def _resume(
        self, mark: RunMark, loose: list[str], complete: bool, overwrite: bool, index_run: str | None, listed: set[str]
    ) -> RunState:
        """Continue the run ``mark`` names, from its shards (none: a new attempt); other runs' are stale."""
        mine = [n for n in loose if shard_run(n) == mark.run[:RUN_TAG]]
        if complete and not (overwrite or mark.overwrite):
            raise OutputError(
                f"{self.target!r} holds a complete dataset, and the interrupted {mark.describe()}, which did not "
                "ask to replace it; pass overwrite=True as well as resume=True to finish that run and replace it"
            )
        state = from_shards(self.store, mine) if mine else RunState(mark.run)
        self._stale = [n for n in loose if n not in mine]
        self.overwrite, self.replaces, self._replaced = complete, index_run, listed
        return self._opened(state, overwrite or mark.overwrite)

    def _opened(self, state: RunState, overwrite: bool) -> RunState:
        """Mark the prefix with this run (before any shard), and return its state."""
        self.run = state.run
        RunMark.now(state.run, overwrite).put(self.store)
        return state

    def _check_ours(self, names: list[str]) -> None:
        """Refuse, before anything is removed, an object named like tdgather's that tdgather did not write."""
        for name in names:
            try:
                if name == INCOMPLETE_NAME:
                    c = Check(self.store.path(name))
                    ok = c.mapping(load_json(self.store.read(name), c, "index"), "index").get("format") == FORMAT
                else:
                    ok = SafetensorsFile(self.store.open(name)).metadata().get("format") == FORMAT
            except DatasetError:
                ok = False
            if not ok:
                raise OutputError(
                    f"output {self.target!r} holds {name!r}, named like tdgather's files but not one tdgather wrote "
                    "(not a tdgather shard or record); tdgather never deletes what it did not write, even with "
                    "overwrite=True: choose another prefix, or move it away"
                )

    def join(self) -> list[str]:
        """Another writer joins the run: nothing to check (it writes its own objects); no shard of its tag is there."""
        return []

    def commit(self, index: Iterable[bytes], shards: Iterable[str]) -> str:
        """The one commit step: check every listed shard is there, put the index if unchanged since open.

        Then remove the objects it does not list (this run's, the replaced run's, those left at
        open); return the URL.

        Raises:
            OutputError: a listed shard is missing, or another run committed meanwhile (named);
                nothing was committed.
        """
        keep = set(shards)
        listing = self.store.list()
        missing = sorted(keep - set(listing))
        if missing:
            raise OutputError(
                f"{self.target!r}: the index would list {describe_names(missing)}, which are not there (another run "
                f"removed them: {self._other()}); nothing was committed. Two jobs wrote one output (a requeue, a "
                "restarted pod): let one finish, then rerun the other with resume=True"
            )
        if not self.store.put_if(INDEX_NAME, b"".join(index), self._base):
            raise OutputError(
                f"{self.target!r}: another run committed a dataset there after this run (run {self.run}) opened: "
                f"{self._other()}; that dataset stays whole and nothing of this run was committed (its shards stay, "
                "unlisted, until the next commit there). Two jobs wrote one output (a requeue, a restarted pod): "
                "keep one of them"
            )
        try:  # committed: what is left is clean-up, and its failure is only storage left behind
            self._clean(listing, keep)
        except Exception as e:
            log.warning(
                "tdgather: %r: committed; removing the objects the index does not list failed (%s: %s): they stay, "
                "unread, until the next commit there",
                self.target,
                type(e).__name__,
                e,
            )
        return self.target

    def _clean(self, listing: dict[str, int], keep: set[str]) -> None:
        """After the commit: remove, by name, the objects of this run, of the one it replaced and those left at open."""
        ours = {run[:RUN_TAG] for run in (self.run, self.replaces) if run}
        stale = set(self._stale)
        for name in sorted(listing):  # by name, only tdgather's: never anything it did not write
            if name in (INCOMPLETE_NAME, RUN_NAME):
                if name == INCOMPLETE_NAME or self._is_my_mark():
                    self.store.remove(name)
            elif SHARD_NAME.fullmatch(name) and name not in keep:
                if shard_run(name) in ours or name in self._replaced or name in stale:
                    self.store.remove(name)  # this run's, the replaced dataset's, or a failed run's left at open
        self.store.abort_uploads(ours)  # S3: an upload a killed attempt of this run (or the replaced one) left

    def _is_my_mark(self) -> bool:
        mark = self._mark_now()
        return mark is not None and mark.run == self.run

    def _mark_now(self) -> RunMark | None:
        """The mark there now; None also where another run removes or rewrites it meanwhile."""
        try:
            return RunMark.read(self.store)
        except DatasetError:
            return None

    def _other(self) -> str:
        """The other run, as the prefix names it: the committed index's run, and the run that opened last.

        Read while the other run may be removing its mark or rewriting the index: what is gone is not named.
        """
        try:
            _, committed, _ = index_runs(self.store)
        except DatasetError:
            committed = None
        mark = self._mark_now()
        said = [f"the index there is run {committed}'s"] if committed and committed != self.run else []
        if mark is not None and mark.run != self.run:
            said.append(f"the last to open it was {mark.describe()}")
        return "; ".join(said) or "no other run is named there"

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
