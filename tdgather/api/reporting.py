"""What rank dst shows while a Collector runs: a progress bar on a terminal, log lines in a job's log.

Under SLURM or Kubernetes stderr is a file, where a tqdm bar is noise, and Python drops INFO lines
when no logging is set up. So with ``progress=None`` (the default) rank dst shows a bar when stderr
is a terminal, and otherwise logs a line on the ``"tdgather"`` logger every `LOG_EVERY` seconds;
`visible` gives that logger a handler to stderr when nothing in the program set up logging, so
the lines and the summary reach the job's log with no setup. ``progress=False`` shows nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

__all__ = ["LOG_EVERY", "Report", "visible"]

log = logging.getLogger("tdgather")

LOG_EVERY = 60.0  # seconds between progress lines in a log


def visible() -> None:
    """Make the ``"tdgather"`` logger's INFO lines reach stderr, unless the program set up logging itself."""
    if log.handlers or logging.getLogger().handlers:
        return  # the program's own setup decides (and ours steps aside once the program sets one up)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    handler.addFilter(lambda record: not logging.getLogger().handlers)  # set up later: the program's alone
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


class Report:
    """Rank dst's progress: a tqdm bar, log lines every ``every`` seconds, or nothing.

    1. ``frames(n)`` as frames arrive (the bar moves);
    2. ``tick()`` now and then (the writer thread, also while nothing arrives): a log line once
       ``every`` seconds have passed since the last;
    3. ``close()``.

    ``describe()`` gives the text after the count (bytes, shards, per rank), computed only when shown.
    """

    def __init__(self, progress: bool | None, describe: Callable[[], str], every: float = LOG_EVERY) -> None:
        terminal = sys.stderr.isatty()
        self.mode = "bar" if progress or (progress is None and terminal) else ("log" if progress is None else None)
        self.describe, self.every = describe, every
        self.count, self.start, self.last = 0, time.monotonic(), time.monotonic()
        self.bar = tqdm(
            desc="tdgather", unit=" frames", disable=self.mode != "bar", dynamic_ncols=True, file=sys.stderr
        )
        if self.mode == "log":
            visible()

    @property
    def shown(self) -> bool:
        """Whether anything is shown (a bar or log lines)."""
        return self.mode is not None

    def frames(self, n: int) -> None:
        """``n`` more frames arrived."""
        self.count += n
        if self.mode == "bar":
            self.bar.set_postfix_str(self.describe(), refresh=False)
            self.bar.update(n)

    def tick(self) -> None:
        """A log line, if ``every`` seconds have passed since the last one."""
        now = time.monotonic()
        if self.mode == "log" and now - self.last >= self.every:
            self.last = now
            log.info("tdgather: %d frames received, %s, %.0f s", self.count, self.describe(), now - self.start)

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()
