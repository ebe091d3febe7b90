"""Job marks: which run a job that appends is, so that its rerun continues it (``append=True, resume=True``).

A job that appends commits all its frames at once, when it ends. One preempted after hours has
written shards (each durable, named by its run) that no snapshot lists. Run again with
``resume=True``, it continues that run: it takes those shards as saved (``Collector.saved``),
computes only the rest, and its commit lists both. To find its run again, a job is known by a key
that stays the same when it is run again: ``TDGATHER_JOB`` where set, else its scheduler's id
(`scheduler_job`: a SLURM array task, a SLURM job, a Kubernetes indexed job's index), which a
requeue keeps.

Each attempt of a job claims a mark, ``tdgather.job-<hash of the key>-<attempt>.json``, written
only if absent (`tdgather.storage.store.Store.put_if`): two copies of one job running at once
claim different attempts, so neither writes over the other's shards; both commit, and each frame
is in the dataset once (the second commit leaves out what the first listed). Marks are small and
stay; they are read as hostile input (`JobMark.read`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass

from ..errors import OutputError
from ..format.check import Check, load_json
from ..format.names import FORMAT, JOB_MARK_NAME, RUN_TAG, SHARD_NAME, job_mark_name, shard_run
from ..format.records import Attempt
from .runstate import RunState, new_run
from .scan import from_shards
from .store import Store

__all__ = ["JOB_VAR", "JobMark", "continue_job", "job_key", "scheduler_job"]

JOB_VAR = "TDGATHER_JOB"  # a job's key across its reruns, where the scheduler sets none (or to choose it)
_SCHEDULER_VARS = ("SLURM_ARRAY_JOB_ID", "SLURM_JOB_ID", "JOB_COMPLETION_INDEX", "TORCHELASTIC_RUN_ID")
_MAX_BYTES = 64 << 10
_RUN = re.compile(r"[0-9a-f]{32}")
_MAX_CLAIMS = 1000  # attempts claimed by other copies of the job before giving up


def scheduler_job() -> str | None:
    """The scheduler's id of this job, where one is set (a SLURM array task, a Kubernetes indexed job)."""
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    for var in _SCHEDULER_VARS:
        if os.environ.get(var):
            return f"{var}={os.environ[var]}" + (f"_{task}" if task and var == "SLURM_ARRAY_JOB_ID" else "")
    return None


def job_key() -> str | None:
    """This job's key across reruns: ``TDGATHER_JOB``, else `scheduler_job`; None where neither is set.

    Not torchrun's ``TORCHELASTIC_RUN_ID``: each launch draws a new one (unless given ``--rdzv-id``),
    so a relaunched job would never find its run.
    """
    job = os.environ.get(JOB_VAR) or scheduler_job()
    return None if job is None or job.startswith("TORCHELASTIC_RUN_ID=") else job


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class JobMark:
    """One attempt of a job: its key, the run it continues (or began), and where and when it opened."""

    job: str
    run: str
    attempt: int
    host: str
    opened: float

    def claim(self, store: Store) -> bool:
        """Write the mark only if no attempt of that number has one; False when another copy of the job did."""
        data = json.dumps({"format": FORMAT, **asdict(self)}).encode()
        return store.put_if(job_mark_name(_hash(self.job), self.attempt), data, None)

    @classmethod
    def read(cls, store: Store, name: str) -> JobMark:
        """The mark ``name``, checked: a small JSON object of the fields and types tdgather writes.

        Raises:
            DatasetError: naming the file and field.
        """
        c = Check(store.path(name))
        size = store.size(name) or 0
        if size > _MAX_BYTES:
            raise c.fail("size", f"a job mark of at most {_MAX_BYTES} bytes", size)
        obj = c.mapping(load_json(store.read(name), c, "mark"), "mark")
        c.obj(obj, "mark", {"format", *cls.__dataclass_fields__})
        if obj["format"] != FORMAT:
            raise c.fail("format", repr(FORMAT), obj["format"])
        run = c.str(obj["run"], "run")
        if not _RUN.fullmatch(run):  # it names shards: never a path
            raise c.fail("run", "a run id of 32 lowercase hex digits (as tdgather writes it)", run)
        opened = obj["opened"]
        if isinstance(opened, bool) or not isinstance(opened, int | float):
            raise c.fail("opened", "a number (seconds since the epoch)", opened)
        mark = cls(c.str(obj["job"], "job"), run, c.int(obj["attempt"], "attempt"), c.str(obj["host"], "host"), opened)
        m = JOB_MARK_NAME.fullmatch(name)
        if m is None or m[1] != _hash(mark.job) or int(m[2]) != mark.attempt:
            raise c.fail("job", f"the job and attempt its name {name!r} carries", (mark.job, mark.attempt))
        return mark


def continue_job(store: Store, key: str, listing: dict[str, int] | None = None) -> RunState:
    """The run that job ``key`` continues (its earlier attempts' shards, as saved), with a new attempt claimed.

    No mark of ``key``: a new run, attempt 1. Else the run of its newest mark: its shards there
    (committed or not) are what it saved, and the attempt is the next one no copy of the job claimed.
    ``listing``: the store's, where the caller has one.

    Raises:
        OutputError: (from `from_shards`) a shard of the run that is not tdgather's.
        DatasetError: a mark or shard that is malformed.
    """
    listing = store.list() if listing is None else listing
    ours = _hash(key)
    marks = sorted(
        (JobMark.read(store, n) for n in listing if (m := JOB_MARK_NAME.fullmatch(n)) and m[1] == ours),
        key=lambda mark: mark.attempt,
    )
    if not marks:
        state, attempt = RunState(new_run()), 1
    else:
        run = marks[-1].run
        names = sorted(n for n in listing if SHARD_NAME.fullmatch(n) and shard_run(n) == run[:RUN_TAG])
        state = from_shards(store, names) if names else RunState(run)
        attempt = max(marks[-1].attempt, state.attempt - 1) + 1
    for _ in range(_MAX_CLAIMS):
        if JobMark(key, state.run, attempt, socket.gethostname(), time.time()).claim(store):
            break
        attempt += 1  # another copy of the job claimed it: the next
    else:
        raise OutputError(f"{store.where!r}: job {key!r}: {_MAX_CLAIMS} attempts were claimed by other copies of it")
    held = {a.attempt for a in state.attempts}  # attempts that saved nothing count too: the next is this one
    state.attempts = sorted(
        [*state.attempts, *(Attempt(a, 0) for a in range(1, attempt) if a not in held)], key=lambda a: a.attempt
    )
    return state
