"""The run mark: ``tdgather.run.json``, which a run writes when it opens, before any shard.

A run that dies before it wrote a shard (SIGKILLed, preempted while its model loads) would leave no
trace, and a resume would take the dataset it was replacing for the one to continue. So every run
(rank dst, when its Collector or `tdgather.save` opens the output) first records who it is: its run
id, whether it may replace the dataset there (``overwrite``), and where and when it opened. A
resume then continues the run the mark names, unless that run committed (`tdgather.storage.prefix`,
`tdgather.storage.resume.load_state`); a commit that finds another run's dataset names that run.
The last run to open wins the mark; the commit never depends on it (it is conditional on the index).

Read as hostile input: a mark that is not a small JSON object of the expected types is a
`tdgather.errors.DatasetError` naming the file and field.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass

from ..format.check import Check, load_json
from ..format.names import FORMAT, RUN_NAME
from .store import Store

__all__ = ["RunMark"]

_MAX_BYTES = 64 << 10
_RUN = re.compile(r"[0-9a-f]{32}")  # `tdgather.storage.runstate.new_run`: uuid4().hex


@dataclass(frozen=True)
class RunMark:
    """Who opened an output last: its run id, whether it may replace a dataset there, and where and when."""

    run: str
    overwrite: bool
    opened: float  # seconds since the epoch
    host: str
    pid: int

    @classmethod
    def now(cls, run: str, overwrite: bool) -> RunMark:
        """This process's mark for ``run``."""
        return cls(run, overwrite, time.time(), socket.gethostname(), os.getpid())

    def put(self, store: Store) -> None:
        """Write it (atomically; the last run to open wins)."""
        store.put(RUN_NAME, [json.dumps({"format": FORMAT, **asdict(self)}).encode()])

    @classmethod
    def read(cls, store: Store) -> RunMark | None:
        """The mark in ``store``, checked; None where there is none."""
        size = store.size(RUN_NAME)
        if size is None:
            return None
        c = Check(store.path(RUN_NAME))
        if size > _MAX_BYTES:
            raise c.fail("size", f"a run mark of at most {_MAX_BYTES} bytes", size)
        obj = c.mapping(load_json(store.read(RUN_NAME), c, "mark"), "mark")
        if obj.get("format") != FORMAT:
            raise c.fail("format", repr(FORMAT), obj.get("format"))
        run = c.str(obj.get("run"), "run")
        if not _RUN.fullmatch(run):  # it names shards: never a path
            raise c.fail("run", "a run id of 32 lowercase hex digits (as tdgather writes it)", run)
        return cls(
            run=run,
            overwrite=_bool(c, obj.get("overwrite"), "overwrite"),
            opened=_number(c, obj.get("opened"), "opened"),
            host=c.str(obj.get("host"), "host"),
            pid=c.int(obj.get("pid"), "pid"),
        )

    def describe(self) -> str:
        """``run 1a2b... (opened 2026-11-27 04:01:05 UTC on host node7, pid 1234)``."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.opened))
        return f"run {self.run} (opened {when} on host {self.host}, pid {self.pid})"


def _bool(c: Check, value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise c.fail(field, "true or false", value)
    return value


def _number(c: Check, value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise c.fail(field, "a number (seconds since the epoch)", value)
    return float(value)
