"""Liveness as progress: a rank is alive while its loop keeps calling into its Collector.

Heartbeats from a background thread prove only that a process lives. A rank whose loop is stuck
(a deadlocked DataLoader worker, a read from a hung filesystem, a GPU kernel that never ends)
keeps its threads, and its heartbeats, alive, and rank dst would wait for it for ever. So each
rank watches its own loop:

1. every call into the Collector (``add``, ``update``, ``status``) is progress (`Progress.touch`),
   and so is every moment spent inside a wait that tdgather controls (back-pressure in ``add``,
   ``close`` waiting for the other ranks: `Progress.waiting`);
2. a `Watchdog` thread looks about once a second; when no progress was made for ``timeout``
   seconds it logs where the stuck thread is (its stack) and hands the rank's side a
   `tdgather.errors.StalledError`;
3. the side fails the run as for an error of its own: a sender sends the chunks it had queued and
   ends its stream with ``error``; rank dst answers every peer ``error``. Every rank then raises,
   naming the stalled rank, within the timeout (plus a second).

A loop that is only slow is never failed as long as the time between two calls stays under the
timeout: set ``timeout`` above the slowest batch (the DataLoader's first one included).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

from ..errors import StalledError

__all__ = ["Progress", "Watchdog"]

log = logging.getLogger("tdgather")

_STACK_FRAMES = 6  # innermost frames of the stuck thread shown in the error


class Progress:
    """When the rank's loop last called into tdgather, and whether it waits inside tdgather now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._what = "opening the Collector"
        self._thread = threading.get_ident()
        self._waiting = 0

    def touch(self, what: str) -> None:
        """A call into tdgather (``what``: ``"add()"``), from the calling thread."""
        self._last, self._what, self._thread = time.monotonic(), what, threading.get_ident()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A wait inside tdgather (back-pressure, close): progress for as long as it lasts."""
        with self._lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
                self._last = time.monotonic()

    def idle(self) -> tuple[float, str, int]:
        """Seconds without progress (0 while waiting inside tdgather), the last call, and its thread's id."""
        with self._lock:
            idle = 0.0 if self._waiting else time.monotonic() - self._last
        return idle, self._what, self._thread


class Watchdog:
    """A daemon thread that calls ``on_stall(StalledError)`` once ``progress`` is idle for ``timeout`` seconds.

    1. ``start()`` when the Collector has opened;
    2. it looks every ``min(1, timeout / 10)`` seconds; the first time the loop has been idle for
       ``timeout``, it logs the stuck thread's stack and calls ``on_stall`` once, then ends;
    3. ``stop()`` when the Collector closes or aborts.
    """

    def __init__(
        self, progress: Progress, timeout: float, rank: int, on_stall: Callable[[StalledError], object]
    ) -> None:
        self.progress, self.timeout, self.rank, self.on_stall = progress, timeout, rank, on_stall
        self.period = min(1.0, timeout / 10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tdgather-watchdog", daemon=True)

    def start(self) -> Watchdog:
        """Start watching."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; wait for the thread (it wakes at once), so that it holds no reference to the side.

        A thread left alive would keep the Collector's process group alive until the interpreter
        exits, and gloo's threads would then be torn down out of order (``terminate called``).
        """
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            idle, what, thread = self.progress.idle()
            if idle >= self.timeout:
                error = StalledError(self.rank, stalled_message(idle, self.timeout, what, thread))
                log.error("tdgather: %s", error)
                self.on_stall(error)
                return


def stalled_message(idle: float, timeout: float, what: str, thread: int) -> str:
    """What a `StalledError` says: how long, the last call, where the thread is stuck, and the fix."""
    frame = sys._current_frames().get(thread)
    where = "".join(traceback.format_stack(frame)[-_STACK_FRAMES:]).rstrip() if frame is not None else "(thread ended)"
    return (
        f"its loop made no call into tdgather for {idle:.1f} s (timeout={timeout:g} s; the last call: {what}); "
        f"the thread that made it is now at:\n{where}\n"
        "If the loop is only slow, pass Collector(timeout=...) above the longest time between two add() calls "
        "(the slowest batch, the DataLoader's first one included)"
    )
