"""`Failure`: the first failure of one rank's part in a Collector call, which all its parts share.

A rank's parts (its chunks, its stream to its writer, a writer's receive and write threads) each
record a failure here, and read it here: the loop's next ``add`` raises it, a stream ends with
``error``. The first one stays. A writer also listens: on the first failure it answers every peer
``error`` at once. So a failure goes one way, from the part that meets it into the record, and
from the record to the writer's answers; no part calls another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Failure"]


class Failure:
    """The first failure of a rank's part in a call.

    1. ``listen(on_first)`` (a writer, once it can answer its peers): ``on_first(e)`` runs on the
       first failure, at once if there is one already;
    2. ``fail(e)``, from any thread: record ``e``, unless a failure was recorded before;
    3. ``error``, ``check()``: read it.

    Example:
        >>> failure = Failure()
        >>> failure.listen(lambda e: print("every peer answered error:", e))
        >>> failure.fail(ValueError("a peer's header"))
        every peer answered error: a peer's header
        True
        >>> failure.fail(OSError("disk full"))  # the first failure stays
        False
        >>> failure.error
        ValueError("a peer's header")
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._on_first: Callable[[BaseException], object] | None = None
        self._lock = threading.Lock()

    def fail(self, e: BaseException) -> bool:
        """Record ``e`` if it is the first failure (then True), and tell the listener."""
        with self._lock:
            if self.error is not None:
                return False
            self.error, on_first = e, self._on_first
        if on_first is not None:
            on_first(e)
        return True

    def listen(self, on_first: Callable[[BaseException], object]) -> None:
        """Run ``on_first(e)`` on the first failure ``e``: now, if it was recorded already."""
        with self._lock:
            self._on_first, error = on_first, self.error
        if error is not None:
            on_first(error)

    def check(self) -> None:
        """Raise the failure, if there is one."""
        if self.error is not None:
            raise self.error
