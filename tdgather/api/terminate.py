"""SIGTERM handled as Ctrl-C is, while a `tdgather.Collector` is open.

SIGTERM is how jobs are really stopped: SLURM's time limit and preemption, Kubernetes' eviction,
``kill``, and torchrun, which SIGTERMs every worker as soon as one of them dies. Python's default
action ends the process at once, and rank dst would lose every frame it holds in memory. While
a Collector is open, `SigtermAsExit` makes SIGTERM raise `tdgather.errors.Terminated` in the main
thread instead, as SIGINT raises ``KeyboardInterrupt``: the Collector aborts (rank dst writes what
it holds and the incomplete record; a sender sends what it holds), and the exception ends the
process with status 143 once it leaves the user's code. Once an abort has begun, for whatever
reason (a SIGTERM, a lost peer, the user's exception), SIGTERM is noted and ignored
(`SigtermAsExit.hold`): torchrun SIGTERMs every worker as soon as one dies, and that SIGTERM must
not cut short the write that keeps what rank dst received (torchrun sends SIGKILL after its grace
period, 30 s by default).

A handler the user installed (any other than the default) is left alone: it decides. The handler
is installed only from the main thread (Python runs signal handlers there), and removed when the
Collector closes, unless someone replaced it meanwhile.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from ..errors import Terminated

__all__ = ["SigtermAsExit"]

log = logging.getLogger("tdgather")


class SigtermAsExit:
    """While installed, SIGTERM raises `Terminated` in the main thread (if the default action was in place).

    1. ``install()`` when a Collector opens;
    2. on SIGTERM, `Terminated` is raised where the main thread is; later SIGTERMs are ignored;
    3. ``hold()`` when an abort begins: from then on SIGTERM is ignored (noted in the log);
    4. ``remove()`` when it closes or aborts: the default action is back.
    """

    def __init__(self) -> None:
        self.installed = False
        self.received = False

    def install(self) -> SigtermAsExit:
        """Take SIGTERM over, if this is the main thread and its action is the default one."""
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is (
            signal.SIG_DFL
        ):
            signal.signal(signal.SIGTERM, self._handle)
            self.installed = True
        return self

    def hold(self) -> None:
        """From now on (an abort is under way), SIGTERM is noted and ignored: it must not cut the abort short."""
        if self.installed and signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._again)

    def remove(self) -> None:
        """Give SIGTERM its default action back, unless another handler replaced ours meanwhile."""
        if self.installed and signal.getsignal(signal.SIGTERM) in (self._handle, self._again):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        signal.signal(signal.SIGTERM, self._again)  # the abort that follows must not be cut short
        log.warning("tdgather: SIGTERM: keeping what this rank holds, then exiting (status %d)", 128 + signum)
        raise Terminated(signum)

    def _again(self, signum: int, frame: Any) -> None:
        log.warning("tdgather: SIGTERM again: ignored while the Collector keeps what it holds")
