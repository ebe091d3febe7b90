"""A local world of N CPU processes on gloo: no cluster, no fixed ports.

Used by ``tdgather demo``, the tests and the benchmarks, in the manner of
torchtnt's ``spawn_multi_process``:

1. a temporary directory holds the rendezvous file (``file://``, so no port is
   chosen by us) and one JSON result file per rank;
2. the ranks start from a forkserver that has torch imported once;
3. each rank joins the gloo group, runs ``fn(*args)``, writes its JSON-able
   return value (or its traceback), and destroys the group;
4. the parent waits at most ``timeout`` seconds, kills what is left, and
   raises `WorldError` if any rank failed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["WorldError", "run_local_world"]

_GRACE_AFTER_FAILURE = 15.0


class WorldError(RuntimeError):
    """A rank of a local world failed, or the world ran out of time.

    Attributes:
        failures: ``{rank: traceback or reason}``.
        results: the values of the ranks that finished (None for the others).
    """

    def __init__(self, message: str, failures: dict[int, str], results: list[Any]) -> None:
        super().__init__(message)
        self.failures = failures
        self.results = results


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    threads_per_rank: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on every rank of a new local gloo world; return each rank's value.

    Args:
        fn: a module-level function (it is imported by name in each rank). It reads its
            rank with ``torch.distributed.get_rank()``. Its return value must be JSON-able.
        world_size: the number of processes.
        *args: JSON-able arguments passed to ``fn`` on every rank.
        timeout: seconds for the whole world; then every rank is killed.
        threads_per_rank: torch intra-op threads per rank (default: cores / world_size, at least 1).

    Returns:
        ``[value of rank 0, value of rank 1, ...]``.

    Raises:
        WorldError: a rank raised, died, or the world timed out.
    """
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tensordict", "tdgather"])
    with tempfile.TemporaryDirectory(prefix="tdgather-world-") as tmp:
        procs = [
            ctx.Process(target=_rank_main, args=(fn, rank, world_size, tmp, threads, timeout, args), daemon=False)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        timed_out = _wait(procs, deadline, tmp)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results: list[Any] = [None] * world_size
        failures: dict[int, str] = {}
        for rank, p in enumerate(procs):
            path = Path(tmp) / f"rank{rank}.json"
            if path.exists():
                record = json.loads(path.read_text())
                if record["ok"]:
                    results[rank] = record["value"]
                else:
                    failures[rank] = record["error"]
            else:
                failures[rank] = (
                    "killed after the world's timeout" if timed_out else f"exited with code {p.exitcode} and no result"
                )
    if failures:
        head = f"local world of {world_size} failed" + (f" (timed out after {timeout:g} s)" if timed_out else "")
        detail = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
        raise WorldError(f"{head}: ranks {sorted(failures)}\n{detail}", failures, results)
    return results


def _wait(procs: list, deadline: float, tmp: str) -> bool:
    """Wait for every rank; after a failure, give the rest a short grace period. True if timed out."""
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if now >= deadline:
            return True
        failed = any(p.exitcode not in (None, 0) for p in procs) or any(
            not json.loads(f.read_text() or '{"ok": true}').get("ok", True) for f in Path(tmp).glob("rank*.json")
        )
        if failed:
            deadline = min(deadline, now + _GRACE_AFTER_FAILURE)
        for p in procs:
            p.join(0.05)
    return False


def _rank_main(fn: Callable, rank: int, world_size: int, tmp: str, threads: int, timeout: float, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    record: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            # every pair connected before any rank runs: a rank that returns (or raises) at once must not
            # close its end while another still builds its connections ("Connection closed by peer")
            dist.barrier()
            record = {"ok": True, "value": fn(*args)}
        finally:
            dist.destroy_process_group()
    except BaseException:
        record = {"ok": False, "error": traceback.format_exc()}
    path = Path(tmp) / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(record))
    os.replace(path.with_suffix(".tmp"), path)
