"""`Link`: one rank's stream to the writer it sends to, in a `tdgather.Collector` call.

A sender's frames go on it, to its block's writer (rank dst, with one writer). A block writer's
stream to the coordinator is a link too, that carries no frames: heartbeats, then ``done`` with its
part (`tdgather.format.blocks`). A thread packs and sends each queued chunk, a data message and its
pieces (through shared memory files when the writer is on this host: `tdgather.comm.shm`), and
sends a heartbeat when idle; another waits for the writer's answer, for as long as the writer sends
heartbeats. Which rank sends to which is `tdgather.api.roles`; the call order, `tdgather.api.choreography`.
"""

from __future__ import annotations

import queue
import time
from typing import Any

from ..comm.groups import heartbeat_interval
from ..comm.pack import pack
from ..comm.protocol import Joiner, end_stream, send_frames
from ..comm.shm import ShmWriter
from ..comm.shmfiles import host_token
from ..comm.transport import Call, peer_error
from ..comm.wire import HEARTBEAT, Kind
from ..errors import PeerLostError, StalledError
from ..format.blocks import check_run
from ..storage.saved import Saved
from .failure import Failure
from .jobs import Job
from .settings import Settings

__all__ = ["Link"]

_POLL = 0.1  # seconds between the send thread's looks at the writer's answer while idle
_AFTER_ANSWER = 5.0  # seconds a link still waits for its sends once the writer has answered
_CLOSE = object()


class Link:
    """The stream to rank ``to``: its ready answer, the queued chunks and heartbeats, ``done`` or ``error``, the answer.

    1. ``open()``: wait for the ready answer (an ``error`` raises `PeerError`): what a resumed run
       saved (``saved``), the coordinator's run (``run``), and whether the writer is on this host;
    2. ``start()``: the send thread and the answer's thread;
    3. chunks go on ``queue`` (`tdgather.api.chunks.Chunks`);
    4. ``close(**done)``: ``done`` (with ``done``'s items) after the queued chunks, then the answer;
       or ``abort(exc, held)``: ``held`` (a sender's last frames), ``error``, the answer, within the timeout.

    ``frames``: whether chunks may still come after a failure (a sender's, at abort). A link that
    carries no frames (a block writer's report) ends with ``error`` as soon as the rank fails.
    """

    def __init__(self, call: Call, to: int, settings: Settings, failure: Failure, frames: bool = True) -> None:
        self.call, self.to, self.failure, self.frames = call, to, failure, frames
        self.timeout = settings.timeout
        self.queue: queue.Queue = queue.Queue(maxsize=settings.max_pending)
        self.saved = Saved()  # what a resumed run saved already (empty for a fresh one)
        self.run: dict | None = None  # with several writers: the coordinator's run and attempt
        self.shm: ShmWriter | None = None  # the writer on this host: chunks through shared memory
        self.sent = 0  # frames sent
        self.done: dict = {}  # what ``done`` carries besides the frames: a writer's report
        self.stalled: StalledError | None = None  # the loop is stuck: the send thread ends the stream
        self.answer: Any = None
        self.ch: Any = None  # the channel to ``to``, from ``open()``
        self.joiner = Joiner(reuse=True)
        self.thread = Job(self._send_loop, "tdgather-send")
        self.watcher = Job(self._watch, "tdgather-answer")

    def open(self) -> None:
        """Wait for the writer's ready answer: the output can be written (else raise its error)."""
        self.ch = self.call.channel(self.to)  # its send and receive sequences are independent
        ready = self.ch.recv_answer()
        if ready.kind == Kind.ERROR:
            raise peer_error(self.ch, ready.header)
        if "saved" in ready.header:
            self.saved = Saved.from_wire(ready.header["saved"], self.to)
        self.run = check_run(ready.header["run"], self.to) if "run" in ready.header else None
        here = host_token()
        self.shm = ShmWriter() if here is not None and ready.header.get("host") == here else None

    def start(self) -> None:
        """Start the send thread and the thread that waits for the answer."""
        self.thread.start()
        self.watcher.start()

    def stall(self, e: StalledError) -> None:
        """From the watchdog: the loop is stuck. The queued chunks go, then ``error`` ends the stream."""
        if self.failure.fail(e):
            self.stalled = e

    def _send_loop(self) -> None:
        heartbeat, last = heartbeat_interval(self.timeout), time.monotonic()
        try:
            while True:
                if self.stalled is not None and self.queue.empty():  # the loop will not end the stream
                    self.ch.wait(end_stream(self.ch, error=self.stalled), "the error message")
                    return
                # end the stream now, not at the loop's next add(), which may be far off
                if self.failure.error is not None and (self.answer is not None or not self.frames):
                    raise self.failure.error
                try:
                    item = self.queue.get(timeout=_POLL)
                except queue.Empty:
                    if time.monotonic() - last >= heartbeat:
                        self.ch.wait(self.ch.send(Kind.DATA, HEARTBEAT), "a heartbeat")
                        last = time.monotonic()
                    continue
                last = time.monotonic()
                if item is _CLOSE:
                    self.ch.wait(end_stream(self.ch, self.sent, **self.done), "the done message")
                    return
                if isinstance(item, BaseException):
                    self.ch.wait(end_stream(self.ch, error=item), "the error message")
                    return
                arena = item.arena  # a sender's chunk is a store: its batches may be in an shm file already
                self.ch.wait(send_frames(self.ch, pack(item), self.joiner, self.shm, arena), "a chunk")
                self.joiner.wait(self.ch)
                if arena is not None:  # every send from it is done: not sent in it, its file goes back to the ring
                    arena.release()
                self.sent += len(item)
        except BaseException as e:
            self.failure.fail(e)
            if not isinstance(e, PeerLostError):  # the stream still works: end it, so the writer need not wait
                try:
                    self.ch.wait(end_stream(self.ch, error=e), "the error message")
                except PeerLostError:
                    pass

    def _watch(self) -> None:
        try:
            answer = self.ch.recv_answer()  # as long as the writer sends heartbeats, however long its work takes
        except BaseException as e:
            self.failure.fail(e)
            return
        if answer.kind == Kind.ERROR:
            self.failure.fail(peer_error(self.ch, answer.header))
        self.answer = answer  # after the failure is recorded: the send loop reads both

    def close(self, **done: Any) -> None:
        """Send ``done`` (with ``done``'s items) after the queued chunks; wait for the answer (raises if ``error``)."""
        self.failure.check()
        self.done = done
        self._put(_CLOSE)
        self._join_send_thread()
        self.failure.check()
        self.watcher.join()  # ends with the writer's answer, or once the writer is silent for the timeout
        self._clean_shm()
        self.failure.check()

    def _put(self, item: Any) -> None:
        """Queue an item, waiting while the queue is full, not past a failure."""
        while True:
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                if self.failure.error is not None:
                    raise self.failure.error from None

    def abort(self, exc: BaseException, held: Any = None) -> None:
        """Send ``held`` (a sender's last frames), end the stream with ``error``, and wait (bounded) for the answer.

        The frames added before the failure are whole, so they go to the writer, which keeps them in
        ``<path>.partial``; unless the writer has failed already (it stops reading) or is lost.
        """
        self.failure.fail(exc)
        deadline = time.monotonic() + self.timeout.total_seconds()
        if held is not None:
            self._put_while_sending(held, deadline)
        self._put_while_sending(exc, deadline)
        self._join_send_thread()
        self.watcher.join(self.timeout.total_seconds())
        self._clean_shm()

    def _clean_shm(self) -> None:
        """Once the writer has answered (it has read every data message), remove the shm files it did not take."""
        if self.shm is not None and not self.watcher.is_alive():
            self.shm.cleanup()

    def _put_while_sending(self, item: Any, deadline: float) -> None:
        """Queue an item behind the unsent chunks; if the send loop ends or stalls first, drop them all."""
        while self.thread.is_alive() and time.monotonic() < deadline:
            try:
                self.queue.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue
        while not self.queue.empty():
            self.queue.get_nowait()

    def _join_send_thread(self) -> None:
        """Wait for the send thread: at most the timeout, and only briefly once the writer has answered.

        After its answer, the writer reads the rest of the stream, unless it stopped reading it (our
        bytes broke the protocol): then a send never completes, and waiting for it would only delay the error.
        """
        deadline = time.monotonic() + self.timeout.total_seconds()
        answered = None
        while self.thread.is_alive() and time.monotonic() < deadline:
            self.thread.join(0.05)
            if not self.watcher.is_alive():
                answered = answered or time.monotonic()
                if time.monotonic() - answered > _AFTER_ANSWER:
                    return
