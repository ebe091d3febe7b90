"""What each rank does at a `tdgather.Collector`'s open, close and abort: one function each, by role.

A rank's share of a call (`Rank`) is made of components its role chooses (`tdgather.api.roles`):

- every rank: `tdgather.api.chunks.Chunks` (its loop's frames, on a bounded queue) and a
  `tdgather.api.failure.Failure` (its first failure, which every component records and reads);
- a sender: a `tdgather.api.sending.Link` to its writer, whose queue its chunks go on;
- a writer (rank dst, the coordinator, a block writer): a `tdgather.api.destination.Destination`,
  whose inbox its chunks go into;
- a block writer: also a `Link` to the coordinator, which carries no frames, only its report.

`open_rank`, `close_rank` and `abort_rank` are the steps of each entry point, in order, naming
which rank takes each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..comm.transport import Call
from ..errors import StalledError
from ..storage.saved import Saved
from .chunks import Chunks
from .destination import Destination
from .failure import Failure
from .liveness import Progress
from .roles import Role
from .sending import Link
from .settings import CollectorStatus, CollectorSummary, Settings

__all__ = ["Rank", "abort_rank", "close_rank", "open_rank"]


@dataclass
class Rank:
    """One rank's components in an open Collector call; which exist follows from ``role``.

    The loop's ``add`` and ``update`` go to ``chunks`` on every rank.
    """

    role: Role
    failure: Failure
    chunks: Chunks
    link: Link | None = None  # a sender's stream to its writer; a block writer's to the coordinator
    destination: Destination | None = None  # a writer's

    @property
    def saved(self) -> Saved:
        """What earlier attempts saved, as the writer said (the same on every rank)."""
        return self.chunks.saved

    def status(self) -> CollectorStatus:
        """A writer's frames received and shards written; a sender's back-pressure."""
        if self.destination is not None:
            return self.destination.status()
        return CollectorStatus(pending_peak=self.chunks.pending_peak)

    def stall(self, e: StalledError) -> None:
        """From the watchdog: the loop is stuck.

        A sender's queued chunks go, then ``error`` ends its stream; a writer answers every peer
        ``error`` naming it, and writes what reaches it: the shards it commits stay readable with
        ``incomplete=True``, as when it is killed (the loop that would write the record is stuck).
        """
        if self.destination is None:
            self.link.stall(e)
        else:
            self.failure.fail(e)


def open_rank(role: Role, settings: Settings, call: Call | None, rank: int, progress: Progress) -> Rank:
    """Open this rank's share of the call (``call`` is None without a process group); it raises on a failure.

    1. a sender, and a block writer (towards the coordinator): wait for the ready answer of the rank it
       sends to (an ``error`` raises `PeerError`): what a resumed run saved, the coordinator's run,
       whether it is on this host; then start the link's send thread and the thread that waits for the answer;
    2. a writer: check the metadata and open its sink (rank dst checks the output directory; a block
       writer's sink joins the coordinator's run); answer every peer ready, with what was
       saved (the coordinator adds the run), or ``error`` and raise (a block writer's link then ends with it);
    3. a writer: from now on its first failure answers every peer ``error``; start the heartbeats, a
       receive thread per peer, and the write thread;
    4. every rank: its loop's chunks go on the link's queue (a sender) or into its own inbox (a writer).
    """
    failure = Failure()
    link = None
    if role.to is not None:  # 1.
        link = Link(call, role.to, settings, failure, frames=not role.writes)
        link.open()
        link.start()
    if not role.writes:  # 4., a sender
        arenas = link.shm.arena if link.shm is not None else None  # its batches copied into shared memory
        chunks = Chunks(settings, link.saved, failure, progress, link.queue, arenas=arenas)
        return Rank(role, failure, chunks, link=link)
    if link is None:  # rank dst: its sink says what was saved
        destination = Destination(settings, call, rank, role, failure)
    else:  # a block writer: the coordinator says, and gives the run its sink joins
        destination = Destination(settings, call, rank, role, failure, joins=link.run, saved=link.saved)
    try:
        destination.open()  # 2.
        destination.start()  # 3.
    except BaseException as e:
        if link is not None:
            link.abort(e)
        raise
    chunks = Chunks(settings, destination.saved, failure, progress, destination.inbox, source=rank)  # 4.
    return Rank(role, failure, chunks, link=link, destination=destination)


def close_rank(r: Rank) -> CollectorSummary | None:
    """Finish this rank's share of the call: on rank dst, return the summary; elsewhere None. Raises a failure.

    1. every rank: the frames it holds go on its queue;
    2. a sender: ``done`` after its chunks, then it waits for its writer's answer (an ``error`` raises). Done;
    3. a writer: once every stream has ended, its own included, the last shards are written;
    4. the coordinator: every other writer's shards go into its index (copies across writers resolved);
    5. rank dst commits the index; a block writer makes its shards durable, sends its report to the
       coordinator and waits for its answer (an ``error`` raises);
    6. a writer answers its peers ``done`` (a block writer, with the coordinator's frame count);
       rank dst returns the summary.
    """
    r.failure.check()
    closing = time.perf_counter()
    r.chunks.flush()  # 1.
    d = r.destination
    if d is None:  # 2.
        r.link.close()
        return None
    d.finish()  # 3.
    combined = 0.0
    if r.role.writers:  # 4.
        combining = time.perf_counter()
        d.combine()
        combined = time.perf_counter() - combining
    dups = d.commit()  # 5.
    if r.link is not None:
        r.link.close(report=d.report(dups))
        d.answer_done(r.link.answer.header["frames"])  # 6.
        d.remove_lost_shm()
        return None
    d.answer_done(d.sink.frames)  # 6.
    summary = d.summary(dups, closing, combined)
    d.remove_lost_shm()
    return summary


def abort_rank(r: Rank, exc: BaseException) -> None:
    """Stop this rank's share of the call because of ``exc``: what reached a writer is kept, and no index is written.

    1. every rank: ``exc`` is its failure, unless one came before (every component reads the first);
       a writer answers every peer ``error`` now (a peer that failed itself, at 3.);
    2. a sender: the frames it holds, then ``error``, go on its link, and it waits for its writer's
       answer, within the timeout. Done;
    3. a writer: its own frames go in, and it writes what arrives until every stream has ended; it
       keeps the shards, listed in ``tdgather.incomplete.json`` (see `Destination.abort`), and
       answers the peers not yet answered ``error``;
    4. a block writer: its link to the coordinator ends with the first failure.
    """
    r.failure.fail(exc)  # 1.
    held = r.chunks.take()
    if r.destination is None:  # 2.
        r.link.abort(exc, held)
        return
    try:
        r.destination.abort(held)  # 3.
    finally:
        if r.link is not None:  # 4.
            r.link.abort(r.failure.error)
