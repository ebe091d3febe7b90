"""`Job`: a daemon thread whose end is an event, so that waiting for it survives a signal.

A Collector waits for its threads in the main thread, where SIGTERM and Ctrl-C raise (`tdgather.api.terminate`).
On Python before 3.13, a ``Thread.join`` interrupted so may release the thread's state lock on its behalf
and mark it ended while it still runs (CPython gh-110052, from the bpo-45274 fix): every later
``join`` returns at once and ``is_alive`` says False. Rank dst then wrote its incomplete record before
its writer thread had written the frames it held, and the process exited under it. An `Event`
waited for again after an interruption tells the truth.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Job"]


class Job:
    """``threading.Thread(target, args, name, daemon=True)``, whose ``join`` and ``is_alive`` rest on an event."""

    def __init__(self, target: Callable[..., Any], name: str, args: tuple = ()) -> None:
        self.done = threading.Event()

        def run() -> None:
            try:
                target(*args)
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the target has returned (or ``timeout`` seconds)."""
        self.done.wait(timeout)

    def is_alive(self) -> bool:
        """Whether it was started and its target has not returned."""
        return self.thread.ident is not None and not self.done.is_set()
